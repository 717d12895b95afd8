"""The trainer's configuration: typed sections, each handed only to the code that uses it.

Every flag is a field of one section (data, codec, codebooks, optimisation, run,
distributed), with its default and help text beside it: the dataclasses are the
single source of truth, and `build_parser` makes one flag per field. The codec's
fields are `models.codec.CodecConfig`'s, so a new codec knob is one edit there.
`config.json` and a checkpoint's "config" hold every field under its flag name, as given (None for an
automatic one: the log says what was chosen), but that a resumed run's "kept" settings are those it keeps from its
checkpoint (`resumed_optim`).

A bad flag or value ends in argparse's message and exit code 2. `--local_rank`
and `--local-rank` are both accepted, for the older `torch.distributed.launch`;
they are launch information, not configuration, and are not saved.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from data.training_data import DataConfig
from errors import BadInputError
from models.codec import CodecConfig
from models.compiled_step import COMPILE_CHOICES, CPU_COMPILE_MIN_MINUTES, CPU_COMPILE_MIN_STEPS
from training.flag_help import FlagHelpFormatter
from training.optimizer import OPTIMIZERS
from training.sync_check import STOP_CHECK_SECONDS

DEFAULT_NCCL_TIMEOUT = 1800  # seconds; PyTorch's own default for NCCL groups
DEFAULT_STEPS = 2000  # with no budget given: at least this many steps, or one epoch if that is more


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return sorted(set(values))


def _number(kind, text: str, minimum_ok, wanted: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):  # no flag means anything by inf or nan: each fails later
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if not minimum_ok(value):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v > 0, "a positive number")


def nonnegative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "zero or more")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    return _number(float, text, lambda v: v >= 0, "zero or more")


def finite_float(text: str) -> float:
    return _number(float, text, lambda v: True, "a number")


def fraction(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def on_off(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


KEPT_ON_RESUME = "a resumed run keeps its checkpoint's unless given"
FIXED_ON_RESUME = "a resumed run trains with its checkpoint's (another given: exit 2)"


def flag(default, help: str | None = None, **metadata):
    """A field that is also a flag, with its default and help text (metadata: see _argparse_options; "kept": a
    resumed run keeps its checkpoint's value unless the flag is given; "fixed": it keeps its checkpoint's, the
    value "fixed" names for a checkpoint from before the field, and refuses another: `resumed_optim`)."""
    if metadata.get("kept"):
        help = f"{help}; {KEPT_ON_RESUME}"
    if "fixed" in metadata:
        help = f"{help}; {FIXED_ON_RESUME}"
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(kw_only=True)
class CodebookConfig:
    """How the codebooks are initialised before the first step and refit after the last."""

    kmeans_init_frames: int = flag(
        16384, "frames per rank for the k-means init of the codebooks, before the first step "
               "(0: k-means on the first training batch)", kind="nonnegative")
    refit_iters: int = flag(
        2, "when the schedule ends (steps, epochs or --max_minutes), Lloyd's k-means iterations on every level "
           "over whole training utterances, before the final eval (0: no refit)", kind="nonnegative")
    refit_frames: int = flag(262144, "frames per rank for the refit: whole utterances drawn at random up to this "
                                     "many (under --max_minutes, at most what fits in a tenth of it)")


@dataclass(kw_only=True)
class OptimConfig:
    max_steps: int | None = flag(None, "steps to train; with none of --max_steps, --epochs and --max_minutes, the "
                                       f"larger of {DEFAULT_STEPS} and one epoch")
    max_minutes: float | None = flag(
        None, "the whole run's time, from the process start to its exit: the loop stops in time for the codebook "
              "refit, the final eval and the checkpoint, and the learning rate finishes its decay when the time "
              "runs out (alone: as many steps as fit; with a step budget: whichever ends first; on several ranks "
              "rank 0's clock decides; a resumed run has what its checkpoint left of it)")
    epochs: int | None = flag(None, "passes over the training frames (used when --max_steps is not given)")
    grad_accum: int = flag(1, "micro-batches per step; gradients are all-reduced on the last one only")
    optimizer: str = flag("adamw", "adamw: AdamW on every parameter; muon: Muon on the codec's conv kernels and "
                                   "AdamW on its biases, one --lr and --weight_decay for both (training/optimizer.py)",
                          choices=OPTIMIZERS, fixed="adamw")
    lr: float = flag(3e-3, "peak learning rate, reached after --warmup_steps (AdamW's; Muon's step is scaled to "
                           "the same size)", kind="positive", kept=True)
    min_lr_ratio: float = flag(0.01, "cosine decay ends at lr x this", kind="fraction", kept=True)
    warmup_steps: int = flag(50, "steps of linear warmup to --lr, before the cosine decay", kind="nonnegative",
                             kept=True)
    weight_decay: float = flag(0.0, "decoupled weight decay", kind="nonnegative", kept=True)
    grad_clip: float = flag(1.0, "gradients are scaled down to this total norm when above it (0: no clipping)",
                            kind="nonnegative", kept=True)
    max_bad_steps: int = flag(10, "non-finite steps in a row (each skipped on every rank) before the run stops",
                              kind="nonnegative")
    precision: str = flag("auto", "auto: bf16 on a GPU that supports it, else fp32",
                          choices=("auto", "fp32", "bf16", "fp16"))
    seed: int = flag(1234, "seed of every random choice: the model's init, the held-out utterances and eval frames, "
                          "the batch plan (lengths and crops), the k-means samples, the quantizer dropout's depth",
                     kind="any")
    compile: str = flag("auto", "run the training forward and backward compiled (torch.compile), one graph per "
                                "segment length, compiled before the first step: auto (on with a GPU; on a CPU, on for "
                                f"a run of at least {CPU_COMPILE_MIN_STEPS} steps and {CPU_COMPILE_MIN_MINUTES:g} "
                                "minutes under --max_minutes, where it pays back its compile time, else off), on, off, "
                                "or cudagraphs (on, each graph captured and replayed as a CUDA graph)",
                        choices=COMPILE_CHOICES)
    deterministic: bool = flag(False, "deterministic kernels only (torch.use_deterministic_algorithms, cuBLAS "
                                      "workspace :4096:8), so that a resumed GPU run matches an unbroken one bit for bit; "
                                      "costs speed (scatter/index_add and GEMMs without their fastest kernels) and "
                                      "about 24 MiB of cuBLAS workspace per stream")


@dataclass(kw_only=True)
class RunConfig:
    output_dir: str = flag("runs/default", "where rank 0 writes config.json, metrics.jsonl and checkpoints/")
    eval_every: int = flag(100, "steps between evals on the held-out frames (and the final one when the schedule "
                                "ends)")
    save_every: int = flag(200, "steps between checkpoints (and one when the run stops)")
    keep_checkpoints: int = flag(3, "the newest this many checkpoints are kept in OUTPUT_DIR/checkpoints")
    log_every: int = flag(10, "steps between train lines in metrics.jsonl (loss, learning rate, speed)")
    resume: str = flag("auto", "auto (last checkpoint in rank 0's --output_dir; every rank loads it), none, "
                               "or a path")
    finetune: bool = flag(False, "resume a checkpoint on other training data than it trained on (other features, "
                                 "files, utterances or frames, of the same dim): the codec's feature statistics are "
                                 "taken from these data, and the checkpoint's data_history records the change; "
                                 "without it such a resume exits 2")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard scalars to OUTPUT_DIR/tensorboard "
                                    "(pip install -r requirements-report.txt)")
    device: str = flag("auto", "auto, cpu, cuda, or cuda:N (single process)")
    threads: int | None = flag(None, "torch's intra-op threads per rank; none: OMP_NUM_THREADS when set, else on a CPU "
                                     "the count a resumed run computed with (its checkpoint's), else the cores this "
                                     "process can get (its CPU affinity and cgroup quota, shared by the node's ranks, "
                                     "less those other processes keep busy at start-up), on a GPU torch's default")


@dataclass(kw_only=True)
class DistConfig:
    nccl_timeout: int | None = flag(None, "process-group timeout in seconds; none: $NCCL_TIMEOUT when set, else "
                                          f"{DEFAULT_NCCL_TIMEOUT}")
    sync_check_every: int = flag(50, "the most steps between cross-rank sync checks: they come at its multiples "
                                     f"and, when steps are slow, about every {STOP_CHECK_SECONDS:g} s in between, "
                                     "so that a stop is agreed within seconds")
    sync_timeout: int = flag(300, "seconds a sync check waits, a peer may stay silent, and a rank may stay in one "
                                  "training phase, before every rank stops")
    slow_phase_timeout: int | None = flag(
        None, "seconds allowed for a slow phase (setup, k-means init and the first step, eval, refit, checkpoint "
              "save), as a phase and as the process groups' timeout; none: twice --nccl_timeout")

    @property
    def slow_phase_s(self) -> int:
        return self.slow_phase_timeout or 2 * self.nccl_timeout


@dataclass
class TrainConfig:
    data: DataConfig
    codec: dict  # CodecConfig's fields but feature_dim, which the data decide: see codec_config()
    codebooks: CodebookConfig
    optim: OptimConfig
    run: RunConfig
    dist: DistConfig
    local_rank: int | None = None  # from torch.distributed.launch's flag; not saved
    typed: frozenset[str] = frozenset()  # the flags on the command line, by field name; not saved

    def codec_config(self, feature_dim: int) -> CodecConfig:
        return CodecConfig(feature_dim=feature_dim, **self.codec)

    def to_dict(self) -> dict:
        """Every flag's value under its name: config.json, and the "config" of a checkpoint."""
        flat = dict(self.codec)
        for section in (self.data, self.codebooks, self.optim, self.run, self.dist):
            flat.update(dataclasses.asdict(section))
        return flat


# argparse group -> the sections whose fields it shows (codec and codebooks share the "codec" group)
GROUPS = {"data": (DataConfig,), "codec": (CodecConfig, CodebookConfig), "optimisation": (OptimConfig,),
          "run": (RunConfig,), "distributed": (DistConfig,)}


def flag_fields(section) -> list[dataclasses.Field]:
    """The fields of a section that are flags: those with a default, unless marked "flag": False."""
    return [f for f in dataclasses.fields(section) if f.metadata.get("flag", True)
            and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)]


def _argparse_options(f: dataclasses.Field) -> dict:
    """argparse options from a field's default, annotation and metadata.

    metadata: "help" (plain text: a % is shown as it is); "choices"; "kind": "nonnegative" or "any" for an int
    (default: positive), "positive", "nonnegative" or "fraction" (0 to 1) for a float (default: any number,
    positive when the default is None); "switch": True for a bool that is off by default but takes a value
    (`--pin_memory true`); "flag": False: not a flag.
    """
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    help_text = f.metadata.get("help")
    options = {"default": default, "help": help_text.replace("%", "%%") if help_text else help_text}
    annotation, kind = str(f.type), f.metadata.get("kind")
    if annotation == "bool":
        # on by default, or a switch: --name [true|false]; else a plain flag that turns it on
        if default or f.metadata.get("switch"):
            return {**options, "nargs": "?", "const": True, "type": on_off}
        return {**options, "action": "store_true"}
    if "choices" in f.metadata:
        choices = f.metadata["choices"]
        return {**options, "choices": choices, "type": type(choices[0])}
    if annotation == "list[int]":
        options["type"] = int_list
    elif annotation.startswith("int"):
        options["type"] = {"nonnegative": nonnegative_int, "any": int}.get(kind, positive_int)
    elif annotation.startswith("float"):
        options["type"] = {"positive": positive_float, "nonnegative": nonnegative_float, "fraction": fraction}.get(
            kind, positive_float if annotation.endswith("None") else finite_float)
    return options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rvq_seamless_gpu_cache_nccl.py",
        description="Train a residual vector quantizer on SeamlessM4T features, on one process or many.",
        formatter_class=FlagHelpFormatter,
        allow_abbrev=False,  # the launcher reads flags by their full names (--output_dir for the flight recorder)
    )
    for title, sections in GROUPS.items():
        group = p.add_argument_group(title)
        for section in sections:
            for f in flag_fields(section):
                group.add_argument(f"--{f.name}", **_argparse_options(f))
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _section(cls, values: dict):
    return cls(**{f.name: values[f.name] for f in flag_fields(cls)})


def parse_args(argv=None) -> TrainConfig:
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    if values["nccl_timeout"] is None:
        env = os.environ.get("NCCL_TIMEOUT")
        try:
            values["nccl_timeout"] = positive_int(env) if env is not None else DEFAULT_NCCL_TIMEOUT
        except argparse.ArgumentTypeError as e:
            parser.error(f"NCCL_TIMEOUT={env!r}: {e}")
    config = TrainConfig(
        data=_section(DataConfig, values),
        codec={f.name: values[f.name] for f in flag_fields(CodecConfig)},
        codebooks=_section(CodebookConfig, values),
        optim=_section(OptimConfig, values),
        run=_section(RunConfig, values),
        dist=_section(DistConfig, values),
        local_rank=values["local_rank"],
        typed=typed_flags(argv),
    )
    downsample = config.codec["downsample"]
    bad = [L for L in config.data.train_lengths if L is not None and L % downsample]
    if bad:
        parser.error(f"segment length(s) {bad} are not multiples of --downsample {downsample}")
    beam, codes = config.codec["beam_size"], config.codec["codebook_size"]
    if beam > codes:  # the beam's first level keeps its best codes: there are only this many (every eval would fail)
        parser.error(f"--beam_size {beam} is larger than --codebook_size {codes}: the beam search keeps at most one "
                     f"code sequence per code of the first level; give --beam_size {codes} or less, or a larger "
                     "--codebook_size")
    if not 0 <= config.optim.seed < 2**32:  # numpy's and torch's generators take no negative seed
        parser.error(f"argument --seed: expected a whole number from 0 to {2**32 - 1}, got {config.optim.seed}")
    if not config.run.output_dir.strip():  # "" would be the current folder
        parser.error("argument --output_dir: expected a folder, got an empty name")
    return config


def typed_flags(argv=None) -> frozenset[str]:
    """The fields whose flags `argv` gives (at their default value too): a parse with every default left out."""
    bare = build_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(bare.parse_args(argv)))


def resumed_optim(optim: OptimConfig, saved: dict, typed: frozenset[str]) -> tuple[OptimConfig, list[str]]:
    """The optimisation settings of a resumed run: each "kept" field (the learning-rate schedule, the update's
    settings) as its checkpoint's run had it (`saved`: the checkpoint's "config"), unless its flag is typed; a
    field the checkpoint predates keeps this run's value. A "fixed" field (the optimizer, whose state the run
    resumes) is always the checkpoint's, its "fixed" value for a checkpoint from before it: BadInputError when the
    flag names another. A new default then never changes a running job's schedule mid-run. Returns the settings
    and one line per field that differs from the flags or defaults."""
    kept, said = {}, []
    for f in dataclasses.fields(OptimConfig):
        fixed = "fixed" in f.metadata
        if not (f.metadata.get("kept") or fixed) or not (f.name in saved or fixed):
            continue
        theirs, ours = saved.get(f.name, f.metadata.get("fixed")), getattr(optim, f.name)
        if theirs == ours:
            continue
        if fixed and f.name in typed:
            raise BadInputError(f"--{f.name} {ours}: the checkpoint's run trained with --{f.name} {theirs}, whose "
                                "state this run resumes; leave the flag out to go on with it, or train afresh in "
                                "another --output_dir")
        if f.name in typed:
            said.append(f"--{f.name} {_shown(ours)} as given (the checkpoint's run trained with {_shown(theirs)})")
        else:
            kept[f.name] = theirs
            said.append(f"--{f.name} {_shown(theirs)}, the checkpoint's run's (this version's default: "
                        f"{_shown(ours)})")
    return dataclasses.replace(optim, **kept), said


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def command_line(values: dict) -> list[str]:
    """The trainer's flags that give back the configuration `values` (config.json's: every flag's value under
    its name, as given), each as it is typed: a plain switch (`--prefetch`) when on, true/false for the others,
    lists comma-separated; a flag at its default is left out (--nccl_timeout's is DEFAULT_NCCL_TIMEOUT, which
    parse_args puts in place of none). Flags it does not know (a config.json of another version) are left out."""
    parser = build_parser()
    argv = []
    for action in parser._actions:
        name = action.dest
        if not action.option_strings or name not in values or action.help == argparse.SUPPRESS:
            continue
        value = values[name]
        if value == (DEFAULT_NCCL_TIMEOUT if name == "nccl_timeout" else action.default):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            if isinstance(value, bool):
                value = str(value).lower()
            elif isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            argv += [action.option_strings[0], str(value)]
    return argv


def save_config(config: TrainConfig, path) -> None:
    with open(path, "w") as f:
        json.dump(config.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
