"""A trained codec from a checkpoint file or a run's --output_dir, for the tools that use one (encode, tokenize,
export); and what the two that write codes with it share: their flags and the settings a code shard records."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from errors import BadInputError, TransientFault
from models.codec import CodecConfig, RVQCodec
from models.codes import code_dtype
from training.checkpoint import load_checkpoint, load_latest, unreadable_reason

# --batch_frames by device: on a CPU the quantizer slows down once a pass's intermediates outgrow the caches
# (benchmarks/bench_encode.py); on a GPU longer passes spread the kernel launches over more frames
BATCH_FRAMES = {"cpu": 2048, "cuda": 32768}


def load_codec(path: str | Path, device: str | torch.device = "cpu") -> tuple[RVQCodec, dict, Path]:
    """(model in eval mode, checkpoint dict, checkpoint file) from a checkpoint file or a run folder (its newest)."""
    path = Path(path)
    if path.is_dir():
        found = load_latest(path / "checkpoints") or load_latest(path)
        if found is None:
            raise BadInputError(f"--checkpoint {path}: no readable step_*.pt in {path}/checkpoints or {path}")
        path, state = found
    elif path.is_file():
        try:
            state = load_checkpoint(path)
        except TransientFault:  # an OS error or exhausted memory while reading: not the file's fault, exit 1
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file is the user's to fix
            raise BadInputError(f"--checkpoint {path} could not be read: {unreadable_reason(path, e)}") from None
    else:
        raise BadInputError(f"--checkpoint {path} does not exist: give a checkpoint file or a run's --output_dir")
    if not isinstance(state, dict) or "model" not in state or "codec" not in state:
        raise BadInputError(f"--checkpoint {path} is not a checkpoint of rvq_seamless_gpu_cache_nccl.py "
                            "(no 'model' and 'codec' entries)")
    model = RVQCodec(CodecConfig(**state["codec"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state, path


def add_codes_args(p: argparse.ArgumentParser) -> None:
    """The flags of tools.encode and tools.tokenize that choose the codes."""
    p.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    p.add_argument("--beam_size", type=int,
                   help="partial code sequences kept per frame by the quantizer's beam search over the levels "
                        "(1: the nearest code at each level, several times faster); default: the codec's "
                        "--beam_size, the one its codebooks were refit for (benchmarks/README.md)")
    p.add_argument("--batch_frames", type=int,
                   help="feature frames per codec forward pass, counted padded (rows x the longest utterance in the "
                        "batch; a longer utterance goes alone); default: "
                        + ", ".join(f"{n} on {device}" for device, n in BATCH_FRAMES.items()))
    p.add_argument("--km", type=int, nargs="?", const=1, metavar="LEVEL",
                   help="also write NAME.km, fairseq's label file (HuBERT's dump_km_label.py): one line per "
                        "utterance, its codes at level LEVEL (from 1; --km alone: 1) (default: no .km)")


def check_codes_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("beam_size", "batch_frames", "km"):  # --num_quantizers: codes_spec names the codec's levels
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be positive, got {value}")


@dataclass
class CodesSpec:
    """The codes a tool writes with a codec: levels kept, beam, integer type, .km level; `settings` are what a
    code shard records and is resumed with."""

    model: RVQCodec
    levels: int
    beam: int
    dtype: np.dtype
    km: int | None
    batch_frames: int
    settings: dict


def codes_spec(args: argparse.Namespace, model: RVQCodec, state: dict, ckpt_path: Path,
               device: torch.device) -> CodesSpec:
    """The codes asked for by the flags of add_codes_args; BadInputError for levels this codec lacks."""
    config = model.config
    q = config.num_quantizers if args.num_quantizers is None else args.num_quantizers
    if not 1 <= q <= config.num_quantizers:
        raise BadInputError(f"--num_quantizers {q}: this codec has levels 1 to {config.num_quantizers}")
    if args.km is not None and args.km > q:
        raise BadInputError(f"--km {args.km}: the codes have levels 1 to {q}")
    beam, dtype = args.beam_size or config.beam_size, code_dtype(config.codebook_size)
    settings = {"checkpoint": str(ckpt_path.resolve()), "step": state.get("step"), "levels": q,
                "codebook_size": config.codebook_size, "downsample": config.downsample, "dtype": dtype.name,
                "feature_dim": config.feature_dim, "beam_size": beam, "km_level": args.km}
    batch_frames = args.batch_frames or BATCH_FRAMES.get(device.type, BATCH_FRAMES["cpu"])
    return CodesSpec(model, q, beam, dtype, args.km, batch_frames, settings)


def describe_codes(spec: CodesSpec) -> str:
    """The codes in words, for the log."""
    config = spec.model.config
    return (f"{spec.levels} of {config.num_quantizers} levels x {config.codebook_size} codes, downsample "
            f"{config.downsample}, {spec.dtype}"
            + (f", beam search {spec.beam} wide" if spec.beam > 1 else ", the nearest code at each level")
            + (f", level {spec.km} also as NAME.km" if spec.km else ""))
