"""The flags of tools.encode and tools.tokenize that choose the codes a codec writes (tools.evaluate's, without --km
and --parquet), as the request rvq_tokenizer/codes_spec.py turns into codes."""
from __future__ import annotations

import argparse
from pathlib import Path

from data.audio.pass_plan import by_device
from data.codes_parquet import require_pyarrow
from errors import SOURCES_INSTALL
from rvq_tokenizer.codes_spec import CodesRequest


def add_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    """--checkpoint, the codec, as tools.encode (and decode), tools.tokenize and tools.evaluate take it."""
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the codec: a checkpoint file, a run's --output_dir (its newest checkpoint), or a folder "
                        "python -m tools.export wrote")


def add_codes_args(p: argparse.ArgumentParser, km: bool = True) -> None:
    """The flags of tools.encode and tools.tokenize that choose the codes (tools.evaluate's, without --km)."""
    levels = p.add_mutually_exclusive_group()
    levels.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    levels.add_argument("--kbps", type=float,
                        help="keep the first levels that make this many kilobits per second of audio (each level "
                             "log2(codebook) bits at the codec's code frame rate: 0.5 kbps for 1024 codes at 50 Hz); "
                             "the shard records the levels (default: all)")
    p.add_argument("--beam_size", type=int,
                   help="partial code sequences kept per frame by the quantizer's beam search over the levels "
                        "(1: the nearest code at each level, several times faster); default: the codec's "
                        "--beam_size, the one its codebooks were refit for (benchmarks/README.md)")
    p.add_argument("--batch_frames", type=int,
                   help="feature frames per codec forward pass, counted padded (rows x the longest utterance in the "
                        "batch; a longer utterance goes alone); default: "
                        + by_device("codec_batch_frames"))
    if not km:
        return
    p.add_argument("--km", type=int, nargs="?", const=1, metavar="LEVEL",
                   help="also write NAME.km, fairseq's label file (HuBERT's dump_km_label.py): one line per "
                        "utterance, its codes at level LEVEL (from 1; --km alone: 1); a finished shard asked for "
                        "another level has its .km written again from its codes (default: no .km)")
    p.add_argument("--parquet", action="store_true",
                   help="also write NAME.codes.parquet once the shard is finished (or found finished without it): "
                        "a row per utterance, its key and its codes at each level, as datasets.load_dataset"
                        f"('parquet') reads it (needs {SOURCES_INSTALL})")


def codes_request(p: argparse.ArgumentParser, args: argparse.Namespace) -> CodesRequest:
    """The flags of add_codes_args as a CodesRequest; argparse's exit 2 for values out of range."""
    km = getattr(args, "km", None)  # tools.evaluate's flags have no --km nor --parquet
    for name, value in (("beam_size", args.beam_size), ("batch_frames", args.batch_frames), ("km", km)):
        if value is not None and value < 1:  # --num_quantizers: codes_spec names the codec's levels
            p.error(f"--{name} must be positive, got {value}")
    parquet = getattr(args, "parquet", False)
    if parquet:
        require_pyarrow()  # before any work: exit 2 naming the install line
    return CodesRequest(args.num_quantizers, args.beam_size, args.batch_frames, km, parquet, args.kbps)
