"""What tools.extract and tools.tokenize share: the audio files a process takes, the flags of their input
pipeline, and what a w2v-bert shard records of its passes, compile and attention kernel (the shard itself, and
its loop over windows of files: data/resumable_shard.py ShardWriter).

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

from data.attention_choice import choose_kernel, cpu_kernel, pass_shapes, unavailable
from data.audio_features import FRAME_RATE, W2vBertLayer
from data.audio_sources import (AUDIO_COLUMN, AUDIO_EXTENSIONS, KEY_COLUMNS, SourceFlags, Utterances, listing,
                                source_share)
from data.audio_pipeline import STAGES, WRITER_STAGES, FeatureWindows
from data.pass_plan import GRAPH_PASS_RULE, PASS_COST, PASS_RULE, by_device, device_defaults
from data.w2v_graphs import GRAPH_FRAMES
from data.w2v_attention import KERNELS
from errors import EXIT_OK, BadInputError
from training.device import shard_device

COMMIT_FILES = 1000  # --commit_files by default
# the flags that decide w2v-BERT's passes, recorded in a w2v-bert shard's settings
PASS_FLAGS = ("batch_seconds", "commit_files", "commit_seconds")
# how w2v-BERT computes, flags a w2v-bert shard records when on and goes on with (shard_switches)
SWITCHES = ("compile", "graphs")


@dataclasses.dataclass
class AudioShare:
    """This process's utterances (data/audio_sources.py): units start..end-1 of the source's `total`."""

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
                   help="w2v-bert: padded audio per forward pass at most (rows x the longest chunk; a longer chunk "
                        "goes alone); a window's chunks, sorted by length, are cut into the passes that cost least, "
                        f"a pass costing its padding and {PASS_COST:g} of a full pass; default: "
                        + by_device("batch_seconds"))
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
                        f"padded to a multiple of {GRAPH_FRAMES} frames (data/w2v_graphs.py); not measured on a GPU yet "
                        "(benchmarks/README.md); a shard goes on as it was begun; default: off")
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
class PipelineSettings:
    """The input pipeline: the device, the decoding workers, w2v-BERT's passes and the commits."""

    device: str  # --device as given (auto, cpu, cuda, cuda:1 ...)
    num_workers: int
    batch_seconds: float | None  # None: the device's default (data/pass_plan.py DEVICE_DEFAULTS)
    commit_files: int
    commit_seconds: float
    compile: bool  # w2v-bert: the truncated encoder under torch.compile
    graphs: bool  # w2v-bert: its passes replayed from CUDA graphs (data/w2v_graphs.py)
    switches_given: frozenset[str]  # the SWITCHES named on the command line
    attention: str | None  # w2v-bert: --attention as given (None: auto)
    pass_flags_given: frozenset[str]  # the PASS_FLAGS named on the command line

    def batch_seconds_on(self, device: torch.device) -> float:
        return self.batch_seconds or device_defaults(device.type).batch_seconds


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


def default_pipeline(device: str) -> PipelineSettings:
    """The input pipeline with every flag at its default, for --device `device` (auto, cpu, cuda, cuda:1 ...):
    what tools.extract and tools.tokenize run without flags, and rvq_tokenizer.py always."""
    return PipelineSettings(device=device, num_workers=default_workers(), batch_seconds=None,
                            commit_files=COMMIT_FILES, commit_seconds=device_defaults(device_kind(device)).commit_seconds,
                            compile=False, graphs=False, switches_given=frozenset(), attention=None,
                            pass_flags_given=frozenset())


def default_workers() -> int:
    """--num_workers by default: this process's share of the CPUs it may use, less one for the model (more
    workers than CPUs only wait for one another, and torch warns about each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1)


def device_kind(flag: str) -> str:
    """cuda or cpu: the kind of device --device names (auto: cuda where a GPU is visible), for the defaults that
    depend on it before the device is chosen; a flag that names no device is training/device.py's to refuse."""
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if flag.startswith("cuda") else "cpu"


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


def begun_before_pass_rules(pipeline: PipelineSettings, recorded: dict | None,
                            log: logging.Logger) -> tuple[PipelineSettings, bool]:
    """(the `pipeline` a shard goes on with, whether `recorded`, a w2v-bert shard's settings, are those of a shard
    begun (or finished) before pass rules and attention were recorded (batch_seconds, and no passes)): such a shard
    was made with passes filled in length order and transformers' own attention. It goes on with them, and with
    its own --batch_seconds, --commit_files and --commit_seconds where no flag names others (a flag that does is
    refused with the shard's other settings), so that it resumes to the bytes of an unbroken run, or is found
    complete; --overwrite starts it over with today's."""
    if not (isinstance(recorded, dict) and "batch_seconds" in recorded and "passes" not in recorded):
        return pipeline, False
    if pipeline.graphs:
        raise BadInputError("the shard was begun before pass rules were recorded: it goes on with its own passes and "
                            "transformers' attention, which no CUDA graph holds: rerun without --graphs on, or "
                            "--overwrite to start it over")
    pipeline = dataclasses.replace(pipeline, **{name: recorded[name] for name in PASS_FLAGS
                                                if name not in pipeline.pass_flags_given and name in recorded})
    log.info("the shard was begun before pass rules were recorded: it goes on with its own (passes filled in length "
             "order, %s s of padded audio each, windows of %s files or %s s; transformers' attention); "
             "--overwrite starts it over with today's", pipeline.batch_seconds, pipeline.commit_files,
             pipeline.commit_seconds)
    return pipeline, True


def shard_switches(pipeline: PipelineSettings, recorded: dict | None) -> PipelineSettings:
    """The `pipeline` a w2v-bert shard begun with settings `recorded` (None: a new one) goes on with: under
    torch.compile and in graph mode as it was begun (pass_settings records each SWITCHES that is on), their last
    bits being their own. A flag that names the other is refused (BadInputError), as the shard's other settings
    are; a shard that records neither was begun eager."""
    if not isinstance(recorded, dict):
        return pipeline
    begun = {name: recorded.get(name) == "on" for name in SWITCHES}
    for name, on in begun.items():
        if name in pipeline.switches_given and getattr(pipeline, name) != on:
            was, now = ("on" if on else "off"), ("off" if on else "on")
            raise BadInputError(f"the shard was begun with --{name} {was}, whose last bits differ from --{name} "
                                f"{now}'s: rerun with --{name} {was} (or without it), or --overwrite to start it over")
    return dataclasses.replace(pipeline, **begun)


def pass_settings(pipeline: PipelineSettings, device: torch.device, before_pass_rules: bool = False,
                  attention: str | None = None) -> dict:
    """What decides w2v-BERT's passes and their bits, for a shard's settings: the passes change a layer's last bits,
    and so do torch.compile (noted when on, so that a shard begun before it was recorded reads as eager) and the
    attention kernel (shard_attention; None for a shard begun before kernels were recorded), so a resumed shard
    keeps them (shard_switches). A shard begun before pass rules were recorded records none
    (begun_before_pass_rules)."""
    return {"batch_seconds": pipeline.batch_seconds_on(device),
            **({} if before_pass_rules else {"passes": GRAPH_PASS_RULE if pipeline.graphs else PASS_RULE}),
            "commit_files": pipeline.commit_files, "commit_seconds": pipeline.commit_seconds,
            **{name: "on" for name in SWITCHES if getattr(pipeline, name)},
            **({} if attention is None else {"attention": attention})}


def shard_attention(encoder: W2vBertLayer, pipeline: PipelineSettings, recorded: dict | None,
                    before_pass_rules: bool, log: logging.Logger) -> str | None:
    """The attention kernel a w2v-bert shard begun with settings `recorded` (None: a new one) computes with, set on
    `encoder`, for its settings (pass_settings): the one it was begun with, or BadInputError naming it when it
    cannot run here or --attention names another (kernels differ in their last bits, and a resumed shard must
    give the bytes of an unbroken run); None for a shard begun before kernels were recorded, which goes on with
    its own (transformers' module before pass rules, else auto). A new shard takes --attention, else under
    --compile the gathered bias (what auto traces), else on a GPU the fastest that agrees with the exact bias
    (data/attention_choice.py), on a CPU the folded kernel."""
    flag = pipeline.attention
    begun = recorded.get("attention") if isinstance(recorded, dict) else None
    if before_pass_rules or (isinstance(recorded, dict) and "passes" in recorded and begun is None):
        if flag is not None:
            raise BadInputError(f"the shard was begun before attention kernels were recorded, with "
                                f"{encoder.attention if before_pass_rules else 'auto'}'s last bits: rerun without "
                                f"--attention {flag}, or --overwrite to start it over with it")
        return None
    if begun is not None:
        if flag is not None and flag != begun:
            raise BadInputError(f"the shard was begun with --attention {begun}, whose last bits differ from --attention "
                                f"{flag}'s: rerun with --attention {begun} (or without it), or --overwrite to start "
                                "it over")
        why = unavailable(begun, encoder.device)
        if why is not None:
            raise BadInputError(f"the shard was begun with the attention kernel {begun}, which cannot run here "
                                f"({why}); another kernel's last bits would differ: resume it where {begun} runs, or "
                                "--overwrite to start it over")
        kernel, how = begun, "the shard's own"
    elif flag is not None:
        why = unavailable(flag, encoder.device)
        if why is not None:
            raise BadInputError(f"--attention {flag} cannot run here ({why}): leave it out to choose a kernel that "
                                "can")
        kernel, how = flag, "--attention"
    elif pipeline.compile:
        kernel, how = "gather", "what the compiled encoder traces"
    elif encoder.device.type == "cpu":
        kernel, how = cpu_kernel(), "the CPU's"
    else:
        frames = int(pipeline.batch_seconds_on(encoder.device) * FRAME_RATE)
        choice = choose_kernel(encoder, pass_shapes(frames, encoder.max_chunk))
        kernel, how = choice.kernel, ("cached: " if choice.cached else "measured: ") + choice.describe()
        if pipeline.graphs and kernel == "stock":  # no graph holds transformers' module: the fastest of ours
            kernel = min((k for k in choice.seconds if k != "stock"), key=choice.seconds.get, default="gather")
            how += f"; {kernel}, the fastest of ours, in graph mode"
    encoder.use_attention(kernel)
    log.info("w2v-bert attention: %s (%s)", kernel, how)
    return kernel


def progress_bar(desc: str, share: AudioShare, done: int) -> tqdm:
    """A bar over the share's utterances that moves with each forward pass (one of k chunks: 1/k per chunk)."""
    noun = share.utterances.noun
    return tqdm(total=len(share.keys), initial=done, desc=desc, unit=noun, dynamic_ncols=True, mininterval=1.0,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} " + noun
                           + "s [{elapsed}<{remaining}{postfix}]")


def time_account(stages: dict[str, float], seconds: float) -> str:
    """Where the `seconds` of a shard went (data/audio_pipeline.py STAGES, WRITER_STAGES: FeatureWindows.stages), as
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
