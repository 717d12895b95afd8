"""Audio -> RVQ codes in one pass, with the features the codec was trained on, never written to disk.

    python -m tools.tokenize MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --checkpoint RUN_DIR_OR_CKPT [--km]
    torchrun --nproc_per_node 8 -m tools.tokenize MANIFEST_OR_DIR SPLIT 1 0 OUT_DIR --checkpoint RUN   # a shard per GPU

The audio and its shards are tools.extract's (a fairseq manifest, a folder, WebDataset tar shards, Hugging Face
parquet or a Lhotse CutSet: data/audio/sources.py; rank RANK of NSHARD takes its contiguous share; under
torchrun each process its part of it: tools/audio_shard.py). The features are those the codec was trained on,
as its checkpoint records them (the trainer notes tools.extract's settings: fbank, or the w2v-BERT model,
layer, chunk length and precision, the fbank's front-end, and the dump's dtype); computed as tools.extract
computes them (data/audio/pipeline.py), with the codec's fbank front-end (transformers' extractor where the
checkpoint names none), and encoded as tools.encode encodes a dump, so that the codes are those of tools.extract
followed by tools.encode, bit for bit on a CPU (whatever the commit sizes: each chunk is a pass of
its own there; on a GPU with the same --batch_seconds and commit sizes). --feature, --layer and --precision, when given, must be the checkpoint's:
another value exits 2, naming both. --w2v_bert gives the w2v-BERT folder where it is not where it was at training; its
files must be the same model.

Written into OUT_DIR, for NAME = {split}_{rank}_{nshard}, as tools.encode writes them: `NAME.codes.npy`,
`NAME.codes.len`, `NAME.codes.json` (the settings, counts and each utterance's feature frames),
`NAME.codes.tsv` (the audio file of each utterance, a fairseq manifest), `NAME.km` with --km,
`NAME.codes.parquet` with --parquet (a row per utterance: its .codes.tsv key and its codes at each level,
data/codes_parquet.py; written also when the shard is found finished without it); and
`NAME.codes.skipped`, the files skipped and why, as tools.extract lists them. Committed every --commit_files
files or --commit_seconds of audio (data/resumable_shard.py): the same command run again after a crash goes
on from the last commit and writes the same bytes as a run never stopped; a finished shard is said to be
complete (exit 0), its .km written again from its codes when --km names another level; one with other
settings is refused unless --overwrite. A second process on the same shard
exits 2, naming the first. Exit codes: 0 done; 1 no file could be tokenized (nothing written); 2 bad
arguments or input, features other than the codec's, or an output that is another's.
"""
from __future__ import annotations

import os

if not __package__:  # a tool run as a file puts tools/ first on the path, where the standard library's tokenize
    import sys  # (imported by logging) finds this file: every such run comes here first, and is told what to do

    CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.stderr.write(f"{sys.argv[0]} is a module of the checkout {CHECKOUT}, not a script: run it there as python -m "
                     f"tools.{os.path.splitext(os.path.basename(sys.argv[0]))[0]} ..., or from any folder with "
                     f"PYTHONPATH={CHECKOUT}\n")
    sys.exit(2)

# numpy's BLAS (the fbank's mel projection) on one thread a process, set before numpy loads: the decoding workers
# are the parallelism, and on busy cores a multi-threaded BLAS made the fbank 2.2x slower (benchmarks/README.md)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from data.audio.features import FEATURES  # noqa: E402
from data.audio.pipeline import Window  # noqa: E402
from data.resumable_shard import shard_settings  # noqa: E402
from data.shard_layout import CODES  # noqa: E402
from errors import EXIT_FAILURE, EXIT_OK  # noqa: E402
from models.codes import TAIL_PADDING  # noqa: E402
from rvq_tokenizer.audio_codec import AudioCodec, audio_codec  # noqa: E402
from rvq_tokenizer.code_shard import CodeShard  # noqa: E402
from rvq_tokenizer.codec_files import open_codec  # noqa: E402
from rvq_tokenizer.codes_spec import CodesRequest, describe_codes  # noqa: E402
from rvq_tokenizer.pipeline_settings import PipelineSettings  # noqa: E402
from rvq_tokenizer.trained_features import PRECISION_NAMES, FeatureFlags  # noqa: E402
from tools.audio_shard import (AudioInput, AudioShare, ShardOutput, add_input_args, audio_share,  # noqa: E402
                               input_settings, model_device, progress_bar, shard_written)
from tools.cli import bad_input_exits_2, run  # noqa: E402
from tools.codes_flags import add_checkpoint_arg, add_codes_args, codes_request  # noqa: E402
from training.faults import FaultInjector  # noqa: E402
from training.flag_help import FlagHelpFormatter  # noqa: E402

log = logging.getLogger("tokenize")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.tokenize", formatter_class=FlagHelpFormatter,
        description="Tokenize audio with a trained codec: the features its checkpoint names, then its codes "
                    "({split}_{rank}_{nshard}.codes.npy/.len/.json/.tsv), the features never written.")
    add_input_args(p)
    add_checkpoint_arg(p)
    add_codes_args(p)
    p.add_argument("--w2v_bert", type=Path,
                   help="w2v-bert: the model's folder on this machine (default: the folder the checkpoint records)")
    p.add_argument("--feature", choices=FEATURES, help="must be the codec's features (default: the checkpoint's)")
    p.add_argument("--layer", type=int, help="w2v-bert: must be the codec's layer (default: the checkpoint's)")
    p.add_argument("--precision", choices=tuple(PRECISION_NAMES),
                   help="w2v-bert: must be the codec's precision (default: the checkpoint's)")
    return p


@dataclasses.dataclass(frozen=True)
class TokenizeSettings:
    """What tools.tokenize's flags ask for."""

    audio: AudioInput
    pipeline: PipelineSettings
    output: ShardOutput
    checkpoint: Path  # the codec: a checkpoint file or a run's --output_dir
    codes: CodesRequest
    features: FeatureFlags


def parse_args(argv=None) -> TokenizeSettings:
    p = build_parser()
    args, audio, pipeline, output = input_settings(p, argv)
    codes = codes_request(p, args)
    features = FeatureFlags(args.feature, args.layer, args.precision, args.w2v_bert)
    return TokenizeSettings(audio, pipeline, output, args.checkpoint, codes, features)


def tokenize(cfg: TokenizeSettings) -> int:
    share = audio_share(cfg.audio)
    device = model_device(cfg.pipeline.device, share)
    model, state, ckpt_path = open_codec(cfg.checkpoint, device)
    out_dir, overwrite = cfg.output.out_dir, cfg.output.overwrite
    name = f"{cfg.audio.split}_{share.rank}_{share.nshard}"
    recorded = None if overwrite else shard_settings(out_dir, name, CODES)
    codec = audio_codec(model, state, ckpt_path, cfg.codes, cfg.features, cfg.pipeline, device, recorded)
    settings = {**codec.codes, "split": cfg.audio.split, **share.settings, **codec.passes}
    shard = CodeShard.begin(out_dir, name, codec.spec, settings, overwrite=overwrite, redo="tokenize the shard again",
                            parquet=cfg.codes.parquet, root=share.root, inputs=len(share.keys))
    if shard is None:  # finished already (its parquet written if asked for and missing)
        log.info("finished successfully")
        return EXIT_OK
    with shard:
        return tokenize_into(cfg, share, name, codec, settings, shard)


def tokenize_into(cfg: TokenizeSettings, share: AudioShare, name: str, codec: AudioCodec, settings: dict,
                  shard: CodeShard) -> int:
    log.info("%s: %s from %s -> %s/%s%s: %s features, %s", name, share.describe(), cfg.audio.source,
             cfg.output.out_dir, name, CODES.array, settings["features"]["feature"], describe_codes(codec.spec))
    shard.say_resumed(share.utterances.noun, len(share.keys))
    began = time.perf_counter()
    with progress_bar(f"tokenize {name}", share, shard.done) as bar:
        # half of a file's share of the bar is its features, half its codes
        pipeline = codec.windows(share.utterances, num_workers=codec.pipeline.num_workers, progress=bar.update,
                                 weight=0.5)
        log.info("the fbank is computed %s", f"on {pipeline.device} from the decoded audio"
                 if pipeline.device_fbank else "by the decoding workers")

        def encode(window: Window) -> tuple[np.ndarray, Callable[[], np.ndarray]] | None:
            """(the kept files' feature frames, their codes on the way to the host), computed on this thread where
            the features are: on a GPU the codec's kernels are queued, w2v-BERT's passes of the next window behind
            them, and the host waits only for each window's finiteness (FeatureWindows) and, on the writer
            thread, for the codes it writes."""
            kept = [item for item in window.files if item.skipped is None]
            bar.update(0.5 * (len(window.files) - len(kept)))
            if not kept:
                return None
            return codec.encode(kept, on_batch=lambda batch: bar.update(0.5 * len(batch)))

        def write(window: Window, encoded: tuple[np.ndarray, Callable[[], np.ndarray]] | None) -> None:
            for item in window.files:
                if item.skipped is not None:
                    shard.skip_file(item)
            if encoded is not None:
                lengths, codes_back = encoded
                shard.write(codes_back(), lengths, (f"{item.key}\t{item.samples}" for item in window.files
                                                    if item.skipped is None))

        shard.write_windows(pipeline, write, FaultInjector(share.rank).before_commit, bar, prepare=encode)
    seconds = time.perf_counter() - began
    finished = shard.finish(
        lambda frames, skipped: {
            **settings, "source": str(cfg.audio.source), "utterances": len(frames), "frames": sum(frames),
            "code_frames": shard.rows, "skipped": skipped, "padding": TAIL_PADDING, "feature_frames": frames},
        files=f"all {len(share.keys)} file(s) of shard {share.rank}/{share.nshard}")
    if finished is None:
        return EXIT_FAILURE
    array, frames, skipped = finished
    listed = f", listed in {shard.skipped_list}" if skipped else ""
    wrote = shard.wrote(len(frames), array) + f"; skipped {skipped} file(s){listed}"
    return shard_written(log, pipeline, seconds, "the models", wrote)


@bad_input_exits_2(log)
def main(argv=None) -> int:
    return tokenize(parse_args(argv))


if __name__ == "__main__":
    run(main, "tokenize", resumes=True)
