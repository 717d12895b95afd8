"""The input pipeline of a shard of audio (tools.extract, tools.tokenize) and of rvq_tokenizer: its settings, their
defaults per device, and what a w2v-bert shard records of its passes, compile, graph mode and attention kernel, so
that a resumed shard goes on with them (their last bits are their own) and gives the bytes of an unbroken run.
`resumed_pipeline` and `encoder_passes` are the two steps every w2v-bert shard takes, before and after its encoder
is made."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from data.audio.attention_choice import choose_kernel, cpu_kernel, pass_shapes, unavailable
from data.audio.features import FRAME_RATE, W2vBertLayer
from data.audio.pass_plan import ALONE_RULE, device_defaults, pass_rule
from errors import BadInputError

log = logging.getLogger(__name__)

COMMIT_FILES = 1000  # --commit_files by default
# the flags that decide w2v-BERT's passes, recorded in a w2v-bert shard's settings
PASS_FLAGS = ("batch_seconds", "commit_files", "commit_seconds")
# how w2v-BERT computes, flags a w2v-bert shard records when on and goes on with (shard_switches)
SWITCHES = ("compile", "graphs")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """The input pipeline: the device, the decoding workers, w2v-BERT's passes and the commits."""

    device: str  # --device as given (auto, cpu, cuda, cuda:1 ...)
    num_workers: int
    batch_seconds: float | None  # None: the device's default (data/audio/pass_plan.py DEVICE_DEFAULTS)
    commit_files: int
    commit_seconds: float
    compile: bool  # w2v-bert: the truncated encoder under torch.compile
    graphs: bool  # w2v-bert: its passes replayed from CUDA graphs (data/audio/w2v_graphs.py)
    switches_given: frozenset[str]  # the SWITCHES named on the command line
    attention: str | None  # w2v-bert: --attention as given (None: auto)
    pass_flags_given: frozenset[str]  # the PASS_FLAGS named on the command line

    def batch_seconds_on(self, device: torch.device) -> float:
        return self.batch_seconds or device_defaults(device.type).batch_seconds


def default_pipeline(device: str) -> PipelineSettings:
    """The input pipeline with every flag at its default, for --device `device` (auto, cpu, cuda, cuda:1 ...):
    what tools.extract and tools.tokenize run without flags, and rvq_tokenizer always."""
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


def begun_before_pass_rules(pipeline: PipelineSettings, recorded: dict | None) -> tuple[PipelineSettings, bool]:
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
                  attention: str | None = None, rule: str | None = None) -> dict:
    """What decides w2v-BERT's passes and their bits, for a shard's settings: the passes change a layer's last bits,
    and so do torch.compile (noted when on, so that a shard begun before it was recorded reads as eager) and the
    attention kernel (shard_attention; None for a shard begun before kernels were recorded), so a resumed shard
    keeps them (shard_switches), and its pass rule (`rule`, the one it recorded; None: this device's for a new
    shard, data/audio/pass_plan.py pass_rule). A shard begun before pass rules were recorded records none
    (begun_before_pass_rules)."""
    rule = rule or pass_rule(device.type, pipeline.graphs)
    return {"batch_seconds": pipeline.batch_seconds_on(device),
            **({} if before_pass_rules else {"passes": rule}),
            "commit_files": pipeline.commit_files, "commit_seconds": pipeline.commit_seconds,
            **{name: "on" for name in SWITCHES if getattr(pipeline, name)},
            **({} if attention is None else {"attention": attention})}


def shard_attention(encoder: W2vBertLayer, pipeline: PipelineSettings, recorded: dict | None,
                    before_pass_rules: bool) -> str | None:
    """The attention kernel a w2v-bert shard begun with settings `recorded` (None: a new one) computes with, set on
    `encoder`, for its settings (pass_settings): the one it was begun with, or BadInputError naming it when it
    cannot run here or --attention names another (kernels differ in their last bits, and a resumed shard must
    give the bytes of an unbroken run); None for a shard begun before kernels were recorded, which goes on with
    its own (transformers' module before pass rules, else auto). A new shard takes --attention, else under
    --compile the gathered bias (what auto traces), else on a GPU the fastest that agrees with the exact bias
    (data/audio/attention_choice.py), on a CPU the folded kernel."""
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


def resumed_pipeline(pipeline: PipelineSettings, recorded: dict | None,
                     w2v_bert: bool) -> tuple[PipelineSettings, bool]:
    """(the `pipeline` a shard begun with settings `recorded` (None: a new one) goes on with, whether it was begun
    before pass rules were recorded): a w2v-bert shard keeps its own passes, commits and switches
    (begun_before_pass_rules, shard_switches); a shard of fbank features has no passes to keep."""
    if not w2v_bert:
        return pipeline, False
    pipeline, before_pass_rules = begun_before_pass_rules(pipeline, recorded)
    return shard_switches(pipeline, recorded), before_pass_rules


def encoder_passes(encoder: W2vBertLayer | None, pipeline: PipelineSettings, recorded: dict | None,
                   before_pass_rules: bool) -> dict:
    """What a shard records of w2v-BERT's passes (pass_settings: the pass rule it was begun with, or this device's),
    its attention kernel chosen and set on `encoder` (shard_attention); {} for fbank features (no `encoder`)."""
    if encoder is None:
        return {}
    attention = shard_attention(encoder, pipeline, recorded, before_pass_rules)
    settings = pass_settings(pipeline, encoder.device, before_pass_rules, attention,
                             recorded.get("passes") if isinstance(recorded, dict) else None)
    if settings.get("passes") == ALONE_RULE and "batch_seconds" in pipeline.pass_flags_given:
        log.info("w2v-bert passes: each chunk alone, as on every CPU (--batch_seconds sizes a GPU's passes)")
    return settings
