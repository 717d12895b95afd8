"""What tools.extract and tools.tokenize share: the audio files a process takes, the flags of their input
pipeline (the settings they give: rvq_tokenizer/pipeline_settings.py), the progress bar and the shard's last
lines in the log (the shard itself, and its loop over windows of files: data/resumable_shard.py ShardWriter).

`SOURCE SPLIT NSHARD RANK`: rank RANK of NSHARD takes its contiguous share of the files, as in fairseq's
simple_kmeans. Under torchrun (RANK and WORLD_SIZE in the environment), process r of W takes shard
RANK x W + r of NSHARD x W, and the GPU of its LOCAL_RANK: `torchrun --nproc_per_node 8 -m tools.extract SRC
train 1 0 OUT` writes train_0_8 ... train_7_8, and `... train 2 1 OUT` on a second machine the second half
as train_8_16 ... train_15_16. SLURM's variables are not read: a user of srun passes $SLURM_PROCID as RANK.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from data.audio.pass_plan import PASS_COST, by_device
from data.audio.pipeline import STAGES, WRITER_STAGES, FeatureWindows
from data.audio.sources import (AUDIO_COLUMN, AUDIO_EXTENSIONS, KEY_COLUMNS, SourceFlags, Utterances, listing,
                                source_share)
from data.audio.w2v_attention import KERNELS
from data.audio.w2v_graphs import GRAPH_FRAMES
from errors import EXIT_OK
from rvq_tokenizer.pipeline_settings import COMMIT_FILES, PASS_FLAGS, SWITCHES, PipelineSettings, default_pipeline
from training.device import shard_device


@dataclasses.dataclass
class AudioShare:
    """This process's utterances (data/audio/sources.py): units start..end-1 of the source's `total`."""

    utterances: Utterances
    nshard: int
    rank: int
    local_rank: int  # which of the node's GPUs: LOCAL_RANK under a launcher, else RANK

    @property
    def root(self) -> str:
        return self.utterances.root

    @property
    def keys(self) -> list[str]:
        return self.utterances.keys

    @property
    def settings(self) -> dict:
        """What a shard written from this share is checked against when it is resumed or found finished (a folder's
        or a manifest's as before other sources were read)."""
        u = self.utterances
        kind = {} if u.kind in ("folder", "manifest") else {"source_kind": u.kind}
        return {"root": u.root, **kind, "nshard": self.nshard, "rank": self.rank, "first_file": u.start,
                "files": len(u.keys), "file_list": listing(u.keys), "source_listing": u.source_listing}

    def describe(self) -> str:
        """The share, for the log: `files 0-4 of 10`, `tar files 2-3 of 8 (412 utterances)`."""
        u = self.utterances
        counted = "" if u.unit == "file" else f" ({len(u.keys)} {u.noun}s)"
        return f"{u.unit}s {u.start}-{u.end - 1} of {u.total}{counted}"


def add_input_args(p: argparse.ArgumentParser) -> None:
    """The positionals SOURCE SPLIT NSHARD RANK OUT_DIR and the input pipeline's flags."""
    p.add_argument("source", type=Path,
                   help="a folder of .wav/.flac/.ogg files, a fairseq manifest (.tsv: root line, then "
                        "relpath<TAB>num_samples), WebDataset tar shards (a .tar, a brace pattern such as "
                        "'shards/train-{000000..000099}.tar', or a folder of .tar files), Hugging Face parquet (a "
                        "folder of .parquet files, or a save_to_disk folder), or a Lhotse CutSet (.jsonl[.gz])")
    p.add_argument("split", help="name of the split written, e.g. train or valid")
    p.add_argument("nshard", type=int, help="number of shards the file list is cut into")
    p.add_argument("rank", type=int, help="which shard this process writes (0 .. nshard-1)")
    p.add_argument("out_dir", type=Path, help="the output folder")
    p.add_argument("--device", default="auto",
                   help="auto or cuda (cuda:<rank %% visible GPUs>, or LOCAL_RANK's under torchrun, so that shards "
                        "run side by side), cpu, cuda:1 ...")
    p.add_argument("--num_workers", type=int,
                   help="processes reading and resampling audio ahead of the model, and on a CPU turning it into "
                        "fbank (a GPU computes the fbank itself) (0: a thread of this process); default: the CPUs "
                        "this process may use, shared among a launcher's processes on the node (LOCAL_WORLD_SIZE), "
                        "less one for the model")
    p.add_argument("--batch_seconds", type=float,
                   help="w2v-bert on a GPU: padded audio per forward pass at most (rows x the longest chunk; a longer "
                        "chunk goes alone); a window's chunks, sorted by length, are cut into the passes that cost "
                        f"least, a pass costing its padding and {PASS_COST:g} of a full pass (on a CPU each chunk is "
                        "a pass of its own: as fast, no padding, and its features the same bits in any company); "
                        "default: " + by_device("batch_seconds"))
    p.add_argument("--commit_files", type=int,
                   help="files per commit (their output fsynced, progress recorded): what a killed run does again "
                        "at most, with --commit_seconds; w2v-bert sorts the chunks of these files into its passes; "
                        f"default: {COMMIT_FILES}")
    p.add_argument("--commit_seconds", type=float,
                   help="audio per commit at most: a commit comes after this much audio or --commit_files files; "
                        "w2v-bert's passes are full and little padded when it is several times --batch_seconds; "
                        "default: " + by_device("commit_seconds"))
    p.add_argument("--audio_ext",
                   help="WebDataset shards: the extension of a sample's audio member (default: its first member "
                        f"of {', '.join('.' + e for e in AUDIO_EXTENSIONS)})")
    p.add_argument("--audio_column", default=AUDIO_COLUMN,
                   help="parquet: the Audio column ({bytes, path} per row)")
    p.add_argument("--key_column",
                   help="parquet: the column that names each utterance in the outputs (default: the first of "
                        f"{', '.join(KEY_COLUMNS)} the table has, else file:row)")
    p.add_argument("--compile", choices=("on", "off"),
                   help="w2v-bert on a CPU: run the truncated encoder under torch.compile, with dynamic shapes (the "
                        "graphs compiled are logged; refused on a GPU, where its compile did not finish); not shown "
                        "to pay yet (benchmarks/README.md, \"Tokenization at steady "
                        "state\"); a shard goes on as it was begun; default: off")
    p.add_argument("--graphs", choices=("on", "off"),
                   help="w2v-bert on a GPU: each forward pass replayed from a CUDA graph of its shape, its chunks "
                        f"padded to a multiple of {GRAPH_FRAMES} frames (data/audio/w2v_graphs.py); not measured on a "
                        "GPU yet (benchmarks/README.md); a shard goes on as it was begun; default: off")
    p.add_argument("--attention", choices=KERNELS,
                   help="w2v-bert: the relative-position attention's kernel (docs/audio-to-codes.md); a shard goes on "
                        "with the one it was begun with; default: auto, on a GPU the fastest of those that agree "
                        "with the exact bias, timed once on the run's pass shapes and cached per GPU, on a CPU "
                        "fold")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the shard's output, finished or partial, and write it from the start")


@dataclasses.dataclass(frozen=True)
class AudioInput:
    """The audio a process reads: the source, the split it is written as, and shard RANK of NSHARD (before a
    launcher's processes split it: launched_shard)."""

    source: Path
    split: str
    nshard: int
    rank: int
    flags: SourceFlags  # how to read a container source


@dataclasses.dataclass(frozen=True)
class ShardOutput:
    """Where a shard is written, and whether what is there is started over."""

    out_dir: Path
    overwrite: bool


def input_settings(p: argparse.ArgumentParser,
                   argv) -> tuple[argparse.Namespace, AudioInput, PipelineSettings, ShardOutput]:
    """`argv` (None: the command line) parsed by `p`, and its flags of add_input_args as settings, their defaults
    filled in; argparse's exit 2 for values out of range."""
    args = p.parse_args(None if argv is None else [str(a) for a in argv])
    if args.nshard < 1 or not 0 <= args.rank < args.nshard:
        p.error(f"need nshard >= 1 and 0 <= rank < nshard, got nshard {args.nshard}, rank {args.rank}")
    if args.num_workers is not None and args.num_workers < 0:
        p.error(f"--num_workers must be 0 or more, got {args.num_workers}")
    for name in ("batch_seconds", "max_chunk_seconds", "commit_files", "commit_seconds"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            p.error(f"--{name} must be positive, got {value}")
    if args.graphs == "on" and (args.compile == "on" or args.attention == "stock"):
        p.error("--graphs on replays our attention, eager: not with --compile on or --attention stock (transformers' "
                "module reads its mask back from the device, which no CUDA graph can hold)")
    given = {name: getattr(args, name) for name in ("num_workers", *PASS_FLAGS) if getattr(args, name) is not None}
    pipeline = dataclasses.replace(
        default_pipeline(args.device), **given,
        compile=args.compile == "on", graphs=args.graphs == "on",
        switches_given=frozenset(name for name in SWITCHES if getattr(args, name) is not None),
        attention=None if args.attention in (None, "auto") else args.attention,
        pass_flags_given=frozenset(name for name in PASS_FLAGS if name in given))
    share = AudioInput(args.source, args.split, args.nshard, args.rank,
                       SourceFlags(args.audio_ext, args.audio_column, args.key_column))
    return args, share, pipeline, ShardOutput(args.out_dir, args.overwrite)


def launched_shard(nshard: int, rank: int) -> tuple[int, int, int]:
    """(shards, shard, local rank) of this process: under torchrun, process r of W takes shard rank x W + r of
    nshard x W and GPU LOCAL_RANK; else shard `rank` of `nshard`, on GPU rank % visible GPUs."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world, me = int(env["WORLD_SIZE"]), int(env["RANK"])
        return nshard * world, rank * world + me, int(env.get("LOCAL_RANK", me))
    return nshard, rank, rank


def audio_share(given: AudioInput) -> AudioShare:
    """This process's utterances; BadInputError for a missing, empty or unknown source, or an empty share."""
    nshard, rank, local_rank = launched_shard(given.nshard, given.rank)
    return AudioShare(source_share(given.source, nshard, rank, given.flags), nshard, rank, local_rank)


def model_device(flag: str, share: AudioShare) -> torch.device:
    """The device of this process's model: its own GPU among the node's, for auto or cuda."""
    return shard_device(flag, share.local_rank)


def progress_bar(desc: str, share: AudioShare, done: int) -> tqdm:
    """A bar over the share's utterances that moves with each forward pass (one of k chunks: 1/k per chunk)."""
    noun = share.utterances.noun
    return tqdm(total=len(share.keys), initial=done, desc=desc, unit=noun, dynamic_ncols=True, mininterval=1.0,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} " + noun
                           + "s [{elapsed}<{remaining}{postfix}]")


def time_account(stages: dict[str, float], seconds: float) -> str:
    """Where the `seconds` of a shard went (data/audio/pipeline.py STAGES, WRITER_STAGES: FeatureWindows.stages), as
    shares of them: `time on the model's thread: 62% passes, ...; on the writer's: 30% writing, ...` (a stage under
    half a percent left out)."""
    def shares(names) -> str:
        parts = [f"{share:.0f}% {name}" for name in names
                 if (share := 100 * stages.get(name, 0.0) / max(seconds, 1e-9)) >= 0.5]
        return ", ".join(parts) or "none measurable"

    return (f"time on the model's thread: {shares(STAGES)}, the rest its loop's own; on the "
            f"writer's: {shares(WRITER_STAGES)}")


def shard_written(log: logging.Logger, pipeline: FeatureWindows, seconds: float, model: str, wrote: str) -> int:
    """The end of a shard of audio in the log: the speed and the model's input wait (as the trainer logs its data
    wait), what was written (`wrote`), and that the shard is finished; EXIT_OK."""
    log.info("read %.1f s of audio in %.2f s: %.1f audio seconds per second; %s waited %.2f s (%.0f%%) for decoded "
             "audio (--num_workers %d)", pipeline.audio_seconds, seconds, pipeline.audio_seconds / max(seconds, 1e-9),
             model, pipeline.input_wait, 100 * pipeline.input_wait / max(seconds, 1e-9), pipeline.num_workers)
    log.info("%s", time_account(pipeline.stages, seconds))
    graphed = getattr(pipeline.encoder, "graphed", None)
    if graphed is not None:
        log.info("graph mode: %d pass shapes captured as CUDA graphs, in %.1f s of the start-up and after it",
                 graphed.captures, graphed.capture_seconds)
    log.info("%s", wrote)
    log.info("finished successfully")
    return EXIT_OK
