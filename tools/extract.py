"""Audio -> SeamlessM4T features, written as a fairseq dump (the format data/stores.py reads).

    python -m tools.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature fbank
    python -m tools.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature w2v-bert \\
        --checkpoint /models/w2v-bert-2.0 --layer 17
    torchrun --nproc_per_node 8 -m tools.extract MANIFEST_OR_DIR SPLIT 1 0 OUT_DIR ...   # one shard per GPU

The input is a fairseq manifest (first line the root folder, then `relpath<TAB>num_samples` per line), a
folder searched for .wav, .flac and .ogg files (data/manifests.py), or the corpus as shipped: WebDataset
tar shards, Hugging Face parquet or a save_to_disk folder, a Lhotse CutSet, read in place
(data/audio/sources.py). Rank RANK of NSHARD takes its contiguous share of the files (or tars, parquet files,
cuts), as in fairseq's examples/hubert/simple_kmeans (under torchrun, each process
its part of that share: tools/audio_shard.py). The audio is read by --num_workers processes ahead of
the model, which turn it into fbank too on a CPU (on a GPU the device computes it); the features (`fbank`:
the Seamless front-end, 160-d; `w2v-bert`: a Wav2Vec2BertModel layer, in chunks of at most
--max_chunk_seconds, on a GPU length-sorted into passes of --batch_seconds, on a CPU each chunk a pass of its own)
are data/audio/pipeline.py's; --device and --precision are resolved by training/device.py.
The fbank (the features themselves, or w2v-BERT's input) is computed by --front_end: `torch` (data/audio/fbank.py)
or `transformers` (SeamlessM4TFeatureExtractor), the same features within 1e-4 (data/feature_settings.py);
NAME.json records which.

Written into OUT_DIR, for NAME = {split}_{rank}_{nshard}:
- `NAME.npy`: float32 (or --dtype float16) [frames, dim], every utterance's frames in order;
- `NAME.len`: one frame count per line;
- `NAME.tsv`: the files extracted, in order, as a fairseq manifest (root folder, then
  `relpath<TAB>samples at 16 kHz`), to match features and codes to files; for a tar, parquet or Lhotse
  source, the source, then each utterance's key (the tar key, the key column, the cut id);
- `NAME.skipped`: `relpath<TAB>reason` for every file that was skipped;
- `NAME.json`: the settings (feature kind, dim, front-end, checkpoint, layer, precision, dtype, the share) and
  counts.

The files are committed as they are extracted, every --commit_files files or --commit_seconds of audio
(data/resumable_shard.py): the same command run again after a crash goes on from the last commit and writes
the same bytes as a run never stopped; a finished shard is said to be complete (exit 0); a shard begun or
finished with other settings, or a dump this tool did not write, is refused (exit 2) unless --overwrite,
which starts the shard over. A second process on the same shard exits 2, naming the first.

A file that cannot be read, is empty, too short, truncated or gives non-finite features is skipped, named
and counted; so is one whose name NAME.tsv cannot hold (not UTF-8, or with a line break or a tab); the rest
goes on. A full disk ends the run with one line naming the folder and the space needed, exit 1: the same
command resumes once there is room. Exit codes: 0 done; 1 no file could be extracted (nothing written), or
the disk is full; 2 bad arguments, an empty or missing manifest/folder, or an output that is another's; 130
(ended by SIGINT) Ctrl-C, the shard resumable.
"""
from __future__ import annotations

import os

# numpy's BLAS (the fbank's mel projection) on one thread a process, set before numpy loads: the decoding workers
# are the parallelism, and on busy cores a multi-threaded BLAS made the fbank 2.2x slower (benchmarks/README.md)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from data.audio.features import (FEATURES, FRAME_RATE, FRONT_END, FRONT_ENDS, SAMPLE_RATE, SeamlessFbank,  # noqa: E402
                                 W2vBertLayer)
from data.audio.pipeline import FeatureWindows, Window  # noqa: E402
from data.dump_writer import DUMP_DTYPES  # noqa: E402
from data.feature_settings import RECORDED_BEFORE, model_fingerprint  # noqa: E402
from data.audio.pass_plan import shard_passes, w2v_attention  # noqa: E402
from data.resumable_shard import ShardWriter, shard_settings  # noqa: E402
from data.shard_layout import FEATURE_DUMP  # noqa: E402
from data.transfers import dtype_name  # noqa: E402
from errors import EXIT_FAILURE, EXIT_OK  # noqa: E402
from rvq_tokenizer.pipeline_settings import PipelineSettings, encoder_passes, resumed_pipeline  # noqa: E402
from tools.audio_shard import (AudioInput, AudioShare, ShardOutput, add_input_args, audio_share,  # noqa: E402
                               input_settings, model_device, progress_bar, shard_written)
from tools.cli import bad_input_exits_2, run  # noqa: E402
from training.device import compute_dtype  # noqa: E402
from training.faults import FaultInjector  # noqa: E402
from training.flag_help import FlagHelpFormatter  # noqa: E402

log = logging.getLogger("extract")
# --max_chunk_seconds at least: a chunk is encoded alone, and w2v-BERT's positions reach 64 frames (1.28 s) back
MIN_CHUNK_SECONDS = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.extract",
        description="Extract SeamlessM4T features from audio into a fairseq dump ({split}_{rank}_{nshard}.npy/.len).",
        formatter_class=FlagHelpFormatter,
    )
    add_input_args(p)
    p.add_argument("--feature", choices=FEATURES, default="fbank",
                   help="fbank: Seamless front-end, 160-d; w2v-bert: a Wav2Vec2BertModel layer")
    p.add_argument("--front_end", choices=FRONT_ENDS,
                   help="the fbank's computation, recorded in NAME.json: torch (data/audio/fbank.py) or transformers "
                        "(SeamlessM4TFeatureExtractor, slower), the same features within 1e-4 (default: "
                        f"{FRONT_END}; a shard begun or written before front-ends were recorded goes on with its "
                        f"own, {RECORDED_BEFORE})")
    p.add_argument("--checkpoint", type=Path, help="w2v-bert: local folder of the model (save_pretrained layout) "
                                                   "(default: none; w2v-bert needs it)")
    p.add_argument("--layer", type=int, help="w2v-bert: hidden state after this layer (0 = feature projection; "
                                             "w2v-BERT 2.0 has 24; MaskGCT's semantic codec uses 17) (default: none; "
                                             "w2v-bert needs it)")
    p.add_argument("--max_chunk_seconds", type=float, default=30.0,
                   help="w2v-bert: longer files are encoded in equal chunks of at most this length (at least "
                        f"{MIN_CHUNK_SECONDS:g})")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="w2v-bert: auto is bf16 on a GPU with native bf16, else fp32")
    p.add_argument("--dtype", choices=DUMP_DTYPES, default="float32",
                   help="the dump's dtype: float16 halves disk and IO (values beyond +-65504 make a file skipped)")
    return p


@dataclasses.dataclass(frozen=True)
class FeatureRequest:
    """The features asked for: their kind, the fbank's front-end (None: FRONT_END, or a shard's own), w2v-bert's
    model, layer, chunks and precision, and the dump's dtype."""

    feature: str
    front_end: str | None
    checkpoint: Path | None
    layer: int | None
    max_chunk_seconds: float
    precision: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    """What tools.extract's flags ask for."""

    audio: AudioInput
    pipeline: PipelineSettings
    output: ShardOutput
    features: FeatureRequest


def parse_args(argv=None) -> ExtractSettings:
    p = build_parser()
    args, audio, pipeline, output = input_settings(p, argv)
    if args.feature == "w2v-bert" and (args.checkpoint is None or args.layer is None):
        p.error("--feature w2v-bert needs --checkpoint DIR (a local Wav2Vec2BertModel) and --layer L")
    if args.max_chunk_seconds < MIN_CHUNK_SECONDS:
        p.error(f"--max_chunk_seconds must be at least {MIN_CHUNK_SECONDS:g}, got {args.max_chunk_seconds:g}: w2v-BERT "
                "encodes a chunk without the audio around it")
    features = FeatureRequest(args.feature, args.front_end, args.checkpoint, args.layer, args.max_chunk_seconds,
                              args.precision, args.dtype)
    return ExtractSettings(audio, pipeline, output, features)


def shard_front_end(flag: str | None, recorded: dict | None) -> tuple[str, bool]:
    """(the fbank front-end of a shard begun with settings `recorded`, whether its settings name it): --front_end,
    else FRONT_END; a shard begun or written before front-ends were recorded (its settings name none) goes on with
    its own, unnamed as before, so that it resumes, or is found complete (unless --overwrite starts it over)."""
    legacy = isinstance(recorded, dict) and "feature" in recorded and "front_end" not in recorded
    front_end = flag or (RECORDED_BEFORE if legacy else FRONT_END)
    return front_end, not (legacy and front_end == RECORDED_BEFORE)


def feature_maker(request: FeatureRequest, pipeline: PipelineSettings, device: torch.device, recorded: dict | None,
                  before_pass_rules: bool) -> tuple[SeamlessFbank, W2vBertLayer | None, dict]:
    """(the fbank, the w2v-BERT layer on `device` or None, the feature settings noted in NAME.json), for a shard
    begun with settings `recorded` (None: a new one), `before_pass_rules` or not
    (rvq_tokenizer/pipeline_settings.py)."""
    front_end, named = shard_front_end(request.front_end, recorded)
    fbank = SeamlessFbank(request.checkpoint, front_end)
    settings = {"feature": request.feature, "dim": fbank.dim, "frame_rate_hz": FRAME_RATE,
                "sample_rate": SAMPLE_RATE, **({"front_end": front_end} if named else {}), "precision": "float32",
                "dtype": request.dtype}
    log.info("fbank front-end: %s%s", front_end, "" if named else " (the shard's, begun before front-ends were "
                                                                  "recorded)")
    if request.feature != "w2v-bert":
        return fbank, None, settings
    encoder = W2vBertLayer(request.checkpoint, request.layer, device=device,
                           dtype=compute_dtype(request.precision, device) or torch.float32,
                           max_chunk_seconds=request.max_chunk_seconds, attention=w2v_attention(before_pass_rules),
                           compile=pipeline.compile, graphs=pipeline.graphs)
    settings.update(dim=encoder.dim, checkpoint=str(request.checkpoint.resolve()),
                    model=model_fingerprint(request.checkpoint), layer=request.layer,
                    max_chunk_seconds=request.max_chunk_seconds, precision=dtype_name(encoder.dtype))
    log.info("w2v-bert layer %d of %s on %s (%s), %d-d%s", request.layer, request.checkpoint, encoder.device,
             encoder.dtype, encoder.dim, ", under torch.compile" if encoder.compiled else
             ", in graph mode (CUDA graphs)" if encoder.graphed else "")
    return fbank, encoder, settings


def extract(cfg: ExtractSettings) -> int:
    share = audio_share(cfg.audio)
    device = model_device(cfg.pipeline.device, share)  # before the shard is claimed: a bad --device writes nothing
    out_dir, split = cfg.output.out_dir, cfg.audio.split
    name = f"{split}_{share.rank}_{share.nshard}"
    recorded = None if cfg.output.overwrite else shard_settings(out_dir, name, FEATURE_DUMP)
    pipeline, before_pass_rules = resumed_pipeline(cfg.pipeline, recorded, cfg.features.feature == "w2v-bert")
    cfg = dataclasses.replace(cfg, pipeline=pipeline)
    fbank, encoder, features = feature_maker(cfg.features, cfg.pipeline, device, recorded, before_pass_rules)
    settings = {**features, "split": split, **share.settings,
                **encoder_passes(encoder, cfg.pipeline, recorded, before_pass_rules)}
    dump = FEATURE_DUMP
    writer = ShardWriter.begin(out_dir, name, dump, settings, overwrite=cfg.output.overwrite, log=log,
                               redo="extract the shard again", width=settings["dim"], dtype=cfg.features.dtype,
                               streams={dump.lengths: "", dump.keys: f"{share.root}\n", dump.skipped: ""},
                               inputs=len(share.keys))
    if writer is None:  # finished already
        log.info("finished successfully")
        return EXIT_OK
    with writer:
        return extract_into(cfg, share, name, fbank, encoder, device, settings, writer)


def extract_into(cfg: ExtractSettings, share: AudioShare, name: str, fbank: SeamlessFbank,
                 encoder: W2vBertLayer | None, device: torch.device, settings: dict, writer: ShardWriter) -> int:
    log.info("%s: %s from %s -> %s/%s%s (%s, %d-d)", name, share.describe(), cfg.audio.source, cfg.output.out_dir,
             name, FEATURE_DUMP.array, cfg.features.feature, settings["dim"])
    if writer.done:
        log.info("resuming at %s %d of %d (%d frames committed; %d bytes written after the last commit dropped)",
                 share.utterances.noun, writer.done, len(share.keys), writer.rows, writer.dropped_bytes)
    began = time.perf_counter()
    with progress_bar(f"extract {name}", share, writer.done) as bar:
        pipeline = FeatureWindows(share.utterances, fbank=fbank, encoder=encoder, dtype=cfg.features.dtype,
                                  num_workers=cfg.pipeline.num_workers, commit_files=cfg.pipeline.commit_files,
                                  commit_seconds=cfg.pipeline.commit_seconds,
                                  passes=shard_passes(settings) if encoder else None,
                                  progress=bar.update,
                                  device=encoder.device if encoder else device)
        log.info("the fbank is computed %s", f"on {pipeline.device} from the decoded audio"
                 if pipeline.device_fbank else "by the decoding workers")

        def write(window: Window, _) -> None:
            for item in window.files:
                if item.features is None:
                    writer.skip(log, item)
                else:
                    writer.write(item.features)
                    writer.append(FEATURE_DUMP.lengths, f"{len(item.features)}\n")
                    writer.append(FEATURE_DUMP.keys, f"{item.key}\t{item.samples}\n")

        writer.write_windows(pipeline, write, FaultInjector(share.rank).before_commit, bar)
    seconds = time.perf_counter() - began
    finished = writer.finish_utterances(
        log, FEATURE_DUMP.lengths, lambda lengths, skipped: {
            **settings, "source": str(cfg.audio.source), "utterances": len(lengths), "frames": sum(lengths),
            "skipped": skipped}, files=f"all {len(share.keys)} file(s) of shard {share.rank}/{share.nshard}", indent=1)
    if finished is None:
        return EXIT_FAILURE
    array, lengths, skipped = finished
    frames = sum(lengths)
    return shard_written(log, pipeline, seconds, "the model" if encoder else "the writer",
                         f"wrote {len(lengths)} utterances, {frames} frames ({frames / FRAME_RATE / 60:.1f} min at "
                         f"{FRAME_RATE} Hz) to {array}; skipped {skipped} file(s)"
                         + (f", listed in {name}{FEATURE_DUMP.skipped}" if skipped else ""))


@bad_input_exits_2(log)
def main(argv=None) -> int:
    return extract(parse_args(argv))


if __name__ == "__main__":
    run(main, "extract", resumes=True)
