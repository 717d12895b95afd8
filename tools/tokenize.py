"""Audio -> RVQ codes in one pass, with the features the codec was trained on, never written to disk.

    python -m tools.tokenize MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --checkpoint RUN_DIR_OR_CKPT [--km]
    torchrun --nproc_per_node 8 -m tools.tokenize MANIFEST_OR_DIR SPLIT 1 0 OUT_DIR --checkpoint RUN   # a shard per GPU

The audio and its shards are tools.extract's (a fairseq manifest, a folder, WebDataset tar shards, Hugging Face
parquet or a Lhotse CutSet: data/audio_sources.py; rank RANK of NSHARD takes its contiguous share; under
torchrun each process its part of it: tools/audio_shard.py). The features are those the codec was trained on,
as its checkpoint records them (the trainer notes tools.extract's settings: fbank, or the w2v-BERT model,
layer, chunk length and precision, the fbank's front-end, and the dump's dtype); computed as tools.extract
computes them (data/audio_pipeline.py), with the codec's fbank front-end (transformers' extractor where the
checkpoint names none), and encoded as tools.encode encodes a dump, so that the codes are those of tools.extract
followed by tools.encode, bit for bit on a CPU with the same
--batch_seconds and commit sizes. --feature, --layer and --precision, when given, must be the checkpoint's:
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
complete (exit 0); one with other settings is refused unless --overwrite. A second process on the same shard
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
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data.audio_features import FEATURES, FRONT_ENDS, SeamlessFbank, W2vBertLayer  # noqa: E402
from data.audio_pipeline import AudioFile, FeatureWindows, Window  # noqa: E402
from data.audio_sources import Utterances  # noqa: E402
from data.feature_settings import RECORDED_BEFORE, describe, front_end, model_fingerprint, settings_differ  # noqa: E402
from data.pass_plan import shard_passes, w2v_attention  # noqa: E402
from data.resumable_shard import CODES, ShardWriter, shard_settings  # noqa: E402
from data.transfers import host_copy  # noqa: E402
from errors import EXIT_FAILURE, EXIT_OK, BadInputError  # noqa: E402
from models.codec import RVQCodec  # noqa: E402
from models.codes import TAIL_PADDING, code_frames, km_lines  # noqa: E402
from tools.audio_shard import (AudioInput, AudioShare, PipelineSettings, ShardOutput, add_input_args,  # noqa: E402
                               audio_share, begun_before_pass_rules, input_settings, model_device,
                               pass_settings, progress_bar, shard_attention, shard_switches, shard_written)
from tools.cli import bad_input_exits_2, run  # noqa: E402
from tools.trained_codec import (CodesRequest, CodesSpec, add_codes_args, codes_request, codes_spec,  # noqa: E402
                                 describe_codes, load_codec)
from training.codec_passes import encode_in_batches  # noqa: E402
from training.device import precision_names  # noqa: E402
from training.faults import FaultInjector  # noqa: E402
from training.flag_help import FlagHelpFormatter  # noqa: E402

log = logging.getLogger("tokenize")
PRECISION_NAMES = precision_names("fp32", "bf16")  # --precision -> the name tools.extract records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.tokenize", formatter_class=FlagHelpFormatter,
        description="Tokenize audio with a trained codec: the features its checkpoint names, then its codes "
                    "({split}_{rank}_{nshard}.codes.npy/.len/.json/.tsv), the features never written.")
    add_input_args(p)
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the codec: a checkpoint file, or a run's --output_dir (its newest checkpoint)")
    add_codes_args(p)
    p.add_argument("--w2v_bert", type=Path,
                   help="w2v-bert: the model's folder on this machine (default: the folder the checkpoint records)")
    p.add_argument("--feature", choices=FEATURES, help="must be the codec's features (default: the checkpoint's)")
    p.add_argument("--layer", type=int, help="w2v-bert: must be the codec's layer (default: the checkpoint's)")
    p.add_argument("--precision", choices=tuple(PRECISION_NAMES),
                   help="w2v-bert: must be the codec's precision (default: the checkpoint's)")
    return p


def as_flag(name: str, value=None) -> str:
    """An option (with its value) as a message names it: the command line's `--name value`."""
    return f"--{name}" if value is None else f"--{name} {value}"


@dataclasses.dataclass(frozen=True)
class FeatureFlags:
    """The features' flags: each None, the codec's own (a given one must be the codec's); w2v_bert: where its
    model lies on this machine; named: how a message names an option (rvq_tokenizer.py's are keyword arguments)."""

    feature: str | None
    layer: int | None
    precision: str | None  # fp32 or bf16 (PRECISION_NAMES)
    w2v_bert: Path | None
    named: Callable[..., str] = as_flag


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


def trained_features(state: dict, ckpt_path: Path, flags: FeatureFlags) -> dict:
    """The feature settings the checkpoint records, checked against --feature, --layer and --precision."""
    trained = (state.get("config") or {}).get("features") or {}
    if trained.get("feature") not in FEATURES:
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}: tokenize computes only "
                            "features tools.extract wrote, as the checkpoint of a run on them records (trainers "
                            "before this one recorded none); encode such features with python -m tools.encode")
    given = {k: v for k, v in (("feature", flags.feature), ("layer", flags.layer), ("precision", flags.precision))
             if v is not None}
    asked = {k: PRECISION_NAMES.get(v) if k == "precision" else v for k, v in given.items()}  # as notes say them
    differ = settings_differ(trained, {**trained, **asked})
    if differ:  # the flags that differ, and the fix: the codec's own settings are the default
        other = [flags.named(k, given[k]) for k in asked if trained.get(k) != asked[k]]
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}; the settings given ask "
                            f"for {asked.get('feature', trained['feature'])} features ({differ}): its codes of other "
                            f"features would be meaningless. Leave out {' '.join(other)}: the codec's are the default")
    return trained


def feature_maker(trained: dict, flags: FeatureFlags, device: torch.device, ckpt_path: Path,
                  before_pass_rules: bool, *, compile: bool,
                  graphs: bool = False) -> tuple[SeamlessFbank, W2vBertLayer | None, dict]:
    """(the fbank, the w2v-BERT layer or None, the settings of the features they make), the latter the codec's;
    w2v-BERT from the folder flags.w2v_bert (None: the one the codec records), under torch.compile with `compile`,
    in graph mode with `graphs`, for a shard begun `before_pass_rules` or not (tools/audio_shard.py)."""
    computed = codec_front_end(trained)
    if trained["feature"] != "w2v-bert":
        return SeamlessFbank(None, computed), None, trained
    folder = flags.w2v_bert or Path(trained["checkpoint"])
    if not folder.is_dir():
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}, and {folder} is not a "
                            f"folder here: give the model's folder with {flags.named('w2v_bert', 'DIR')}")
    encoder = W2vBertLayer(folder, trained["layer"], device=device, dtype=getattr(torch, trained["precision"]),
                           max_chunk_seconds=trained["max_chunk_seconds"], flag=flags.named("w2v_bert"),
                           attention=w2v_attention(before_pass_rules),
                           compile=compile, graphs=graphs)
    now = {**trained, "dim": encoder.dim, "checkpoint": str(folder.resolve()), "model": model_fingerprint(folder)}
    differ = settings_differ(trained, now)
    if differ:
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}; "
                            f"{flags.named('w2v_bert', folder)} gives {describe(now)} ({differ})")
    log.info("w2v-bert layer %d of %s on %s (%s), %d-d%s", encoder.layer, folder, encoder.device, encoder.dtype,
             encoder.dim, ", under torch.compile" if encoder.compiled else
             ", in graph mode (CUDA graphs)" if encoder.graphed else "")
    return SeamlessFbank(folder, computed), encoder, now


def codec_front_end(trained: dict) -> str:
    """The fbank front-end the codec's features were made with, as its settings record it; transformers' where they
    name none (checkpoints from before front-ends were recorded) or both (a dump of shards of each)."""
    recorded = front_end(trained)
    computed = recorded if recorded in FRONT_ENDS else RECORDED_BEFORE
    log.info("fbank front-end: %s (the codec's features: %s)", computed,
             recorded if "front_end" in trained else f"no front-end recorded, so {RECORDED_BEFORE}")
    return computed


@dataclasses.dataclass(frozen=True)
class AudioCodec:
    """A codec with the features it was trained on, ready to turn audio into codes: the codes asked for (`spec`),
    the fbank and the w2v-BERT layer (None for fbank features) that compute the features, the input pipeline it
    runs, and what a code shard records of them: `codes` (the codec, its codes and the features) and `passes`
    (w2v-BERT's passes and attention kernel; {} for fbank). tools.tokenize and rvq_tokenizer.py both make their
    codes with it, so the same audio gets the same codes from either."""

    spec: CodesSpec
    fbank: SeamlessFbank
    encoder: W2vBertLayer | None
    pipeline: PipelineSettings
    codes: dict
    passes: dict

    def windows(self, utterances: Utterances, *, num_workers: int, progress: Callable[[float], None] = lambda n: None,
                weight: float = 1.0, on_host: bool = False) -> FeatureWindows:
        """`utterances`' features computed where the codec is, in the pipeline's windows and passes
        (data/audio_pipeline.py): on the host, or (on_host False) left on the device for `encode`."""
        return FeatureWindows(utterances, fbank=self.fbank, encoder=self.encoder, dtype=self.codes["features"]["dtype"],
                              num_workers=num_workers, commit_files=self.pipeline.commit_files,
                              commit_seconds=self.pipeline.commit_seconds,
                              passes=shard_passes(self.passes) if self.encoder else None,
                              progress=progress, weight=weight, device=self.spec.model.feature_mean.device,
                              on_host=on_host)

    def encode(self, kept: list[AudioFile],
               on_batch: Callable[[np.ndarray], None] | None = None) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """(the feature frames of the files `kept`, their codes concatenated on the way to the host: call it for
        them), from the features `windows` left on the device, which are then let go. On a GPU the codec's kernels
        are queued and nothing waits for them here (data/transfers.py host_copy). on_batch(positions) after each of
        the codec's passes."""
        spec = self.spec
        lengths = np.array([len(item.features) for item in kept], dtype=np.int64)
        # the features as the dump would store them (FeatureWindows), where they were computed; widened to float32
        # as tools.encode reads a dump's
        features = SimpleNamespace(lengths=lengths, utterance=lambda i: kept[i].features)
        codes = encode_in_batches(spec.model, features, spec.levels, spec.batch_frames, spec.dtype, spec.beam,
                                  on_batch=on_batch, on_device=True)
        for item in kept:
            item.features = None  # the device's memory back
        return lengths, host_copy(codes)


def audio_codec(model: RVQCodec, state: dict, ckpt_path: Path, request: CodesRequest, flags: FeatureFlags,
                pipeline: PipelineSettings, device: torch.device, recorded: dict | None) -> AudioCodec:
    """The codec `model` (its checkpoint `state`, from `ckpt_path`) with the features its checkpoint records, for a
    shard begun with settings `recorded` (None: a new one, or no shard): a w2v-bert shard goes on with its own
    passes, compile and attention kernel (tools/audio_shard.py). BadInputError for features or codes the codec
    does not have."""
    trained = trained_features(state, ckpt_path, flags)
    spec = codes_spec(request, model, state, ckpt_path, device)
    before_pass_rules = False
    if trained["feature"] == "w2v-bert":  # such a shard goes on with its own passes and commits
        pipeline, before_pass_rules = begun_before_pass_rules(pipeline, recorded, log)
        pipeline = shard_switches(pipeline, recorded)
    fbank, encoder, features = feature_maker(trained, flags, device, ckpt_path, before_pass_rules,
                                             compile=pipeline.compile, graphs=pipeline.graphs)
    codes = {**spec.settings, "features": {k: v for k, v in features.items() if k != "checkpoint"}}
    passes = {}
    if encoder is not None:
        attention = shard_attention(encoder, pipeline, recorded, before_pass_rules, log)
        passes = pass_settings(pipeline, device, before_pass_rules, attention)
    return AudioCodec(spec, fbank, encoder, pipeline, codes, passes)


def tokenize(cfg: TokenizeSettings) -> int:
    share = audio_share(cfg.audio)
    device = model_device(cfg.pipeline.device, share)
    model, state, ckpt_path = load_codec(cfg.checkpoint, device)
    out_dir, overwrite = cfg.output.out_dir, cfg.output.overwrite
    name = f"{cfg.audio.split}_{share.rank}_{share.nshard}"
    recorded = None if overwrite else shard_settings(out_dir, name, CODES)
    codec = audio_codec(model, state, ckpt_path, cfg.codes, cfg.features, cfg.pipeline, device, recorded)
    spec = codec.spec
    settings = {**codec.codes, "split": cfg.audio.split, **share.settings, **codec.passes}
    streams = {CODES.lengths: "", CODES.keys: f"{share.root}\n", CODES.skipped: "", CODES.frames: ""}
    writer = ShardWriter.begin(out_dir, name, CODES, settings, overwrite=overwrite, log=log,
                               redo="tokenize the shard again", width=spec.levels, dtype=spec.dtype,
                               streams={**streams, **({CODES.km: ""} if spec.km else {})}, inputs=len(share.keys),
                               parquet=cfg.codes.parquet)
    if writer is None:
        return EXIT_OK
    with writer:
        return tokenize_into(cfg, share, name, codec, settings, writer)


def tokenize_into(cfg: TokenizeSettings, share: AudioShare, name: str, codec: AudioCodec, settings: dict,
                  writer: ShardWriter) -> int:
    spec = codec.spec
    log.info("%s: %s from %s -> %s/%s%s: %s features, %s", name, share.describe(), cfg.audio.source,
             cfg.output.out_dir, name, CODES.array, settings["features"]["feature"], describe_codes(spec))
    if writer.done:
        log.info("resuming at %s %d of %d (%d code frames committed; %d bytes written after the last commit "
                 "dropped)", share.utterances.noun, writer.done, len(share.keys), writer.rows, writer.dropped_bytes)
    downsample = spec.model.config.downsample
    began = time.perf_counter()
    with progress_bar(f"tokenize {name}", share, writer.done) as bar:
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
                    writer.skip(log, item)
            if encoded is None:
                return
            lengths, codes_back = encoded
            codes = codes_back()
            writer.write(codes)
            code_lengths = code_frames(lengths, downsample)
            writer.append(CODES.lengths, "".join(f"{n}\n" for n in code_lengths))
            writer.append(CODES.keys, "".join(f"{item.key}\t{item.samples}\n" for item in window.files
                                              if item.skipped is None))
            writer.append(CODES.frames, "".join(f"{n}\n" for n in lengths))
            if spec.km:
                writer.append(CODES.km, km_lines(codes, code_lengths, spec.km))

        writer.write_windows(pipeline, write, FaultInjector(share.rank).before_commit, bar, prepare=encode)
    seconds = time.perf_counter() - began
    finished = writer.finish_utterances(
        log, CODES.frames, lambda frames, skipped: {
            **settings, "source": str(cfg.audio.source), "utterances": len(frames), "frames": sum(frames),
            "code_frames": writer.rows, "skipped": skipped, "padding": TAIL_PADDING, "feature_frames": frames},
        files=f"all {len(share.keys)} file(s) of shard {share.rank}/{share.nshard}")
    if finished is None:
        return EXIT_FAILURE
    array, frames, skipped = finished
    if cfg.codes.parquet:
        writer.write_parquet()
    config = spec.model.config
    bits = spec.levels * math.log2(config.codebook_size) / config.downsample
    listed = f", listed in {name}{CODES.skipped}" if skipped else ""
    wrote = (f"wrote {len(frames)} utterances, {writer.rows} code frames ({spec.levels} levels, {bits:.0f} bits/frame "
             f"of features) to {array}; skipped {skipped} file(s){listed}")
    return shard_written(log, pipeline, seconds, "the models", wrote)


@bad_input_exits_2(log)
def main(argv=None) -> int:
    return tokenize(parse_args(argv))


if __name__ == "__main__":
    run(main, "tokenize", resumes=True)
