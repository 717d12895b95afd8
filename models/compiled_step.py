"""The codec's training step under torch.compile: whether a run compiles it (`--compile`), inductor's options and
graph rewrites, the compiled forward with its variants (one graph per input shape and quantize-dropout depth),
and CUDA graphs' first call.

The eval-mode forward, encode and decode stay eager. Measured costs and gains of compiling are in
benchmarks/README.md, "The compiled step".
"""
from __future__ import annotations

import functools
import os
import random
import shutil
from collections.abc import Callable

import torch

from errors import BadInputError
from models.conv_products import ConvProducts
from models.graph_passes import GraphPasses
from models.one_hot_products import OneHotProducts

# The compiled CPU step's graph rewrites (inductor's pre-grad custom pass; the eager step is unchanged): the
# quantizer's products with its one-hot code matrix become a gather and a scatter-add where large, and a small
# convolution one matrix product (benchmarks/README.md, "The compiled step").
ONE_HOT_PRODUCTS, CONV_PRODUCTS = OneHotProducts(), ConvProducts()
# Inductor's options for the compiled training step, by device type. On a CPU its C++ wrapper runs each compiled
# graph instead of the generated Python one: the same kernels, less host time per step (the Python wrapper's
# buffer views and checks), no longer to compile; and the rewrites above. On CUDA neither until a GPU run has
# measured them there (the step is bound by the host, and a product is a tensor-core kernel); --compile cudagraphs
# replays the graphs without a wrapper.
COMPILE_OPTIONS = {"cpu": {"cpp_wrapper": True, "pre_grad_custom_pass": GraphPasses(ONE_HOT_PRODUCTS, CONV_PRODUCTS)}}
# --compile cudagraphs: each compiled graph (forward, backward) captured in a CUDA graph and replayed, its outputs
# static buffers that the next replay overwrites. Not torch.compile's reduce-overhead mode, which is these options
# with cudagraph trees: the trees freed a step's forward outputs while its backward still needed them, and the run
# failed at its second step (benchmarks/README.md, "The compiled step").
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_trees": False}

# --compile: torch.compile's mode for each choice (None: eager)
COMPILE_MODES = {"on": "default", "cudagraphs": "cudagraphs", "off": None}
COMPILE_CHOICES = ("auto", *COMPILE_MODES)
# --compile auto on a CPU compiles a run whose step budget (where given) and --max_minutes (where given) are at least
# these: the compile pays back its time only after a run this long, so a short run stays eager (benchmarks/README.md,
# "The compiled step")
CPU_COMPILE_MIN_STEPS = 1000
CPU_COMPILE_MIN_MINUTES = 5.0


def compile_mode(choice: str, device: torch.device, *, steps: int | None = None,
                 minutes: float | None = None) -> tuple[str | None, str]:
    """torch.compile's mode for the training step under --compile (None: eager), and why. steps: the run's
    steps, if a step budget bounds it; minutes: its --max_minutes. auto: compiled on a GPU, where an eager step
    waits for the host to dispatch its many small ops; on a CPU compiled when the run is long enough to pay back
    the compile time and a C++ compiler is there for inductor's kernels."""
    check_compile(choice, device)
    if choice != "auto":
        return COMPILE_MODES[choice], f"--compile {choice}"
    if device.type == "cuda":
        return COMPILE_MODES["on"], "--compile auto on a GPU"
    if device.type != "cpu":
        return None, f"--compile auto on {device.type}: eager"
    short = []
    if steps is not None and steps < CPU_COMPILE_MIN_STEPS:
        short.append(f"{steps} steps")
    if minutes is not None and minutes < CPU_COMPILE_MIN_MINUTES:
        short.append(f"--max_minutes {minutes:g}")
    if short:
        return None, (f"--compile auto on a CPU: eager for a run of {' or '.join(short)} (compiling pays from "
                      f"{CPU_COMPILE_MIN_STEPS} steps and {CPU_COMPILE_MIN_MINUTES:g} minutes)")
    if cxx_compiler() is None:
        return None, "--compile auto on a CPU: eager, no C++ compiler for inductor (set CXX, or install g++)"
    return COMPILE_MODES["on"], "--compile auto on a CPU, for a run this long"


def check_compile(choice: str, device: torch.device) -> None:
    """--compile cudagraphs needs CUDA: exit 2 before anything is written."""
    if choice == "cudagraphs" and device.type != "cuda":
        raise BadInputError(f"--compile cudagraphs needs a GPU; this run is on {device}: use --compile on or off")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, if one is on the PATH."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


@functools.cache
def depth_seeds(first: int, stop: int) -> dict[int, int]:
    """For each quantize-dropout depth in range(first, stop), the smallest seed from which the library's rule
    (random.Random(seed).randrange(first, stop)) draws it."""
    seeds, seed = {}, 0
    while len(seeds) < stop - first:
        seeds.setdefault(random.Random(seed).randrange(first, stop), seed)
        seed += 1
    return seeds


def dropout_seed(rvq: torch.nn.Module, seed: int | None) -> int | None:
    """The seed handed to the library's quantize dropout (`rvq`, a ResidualVQ with quantize dropout): one that gives
    the depth `seed` would (the library's own rule, random.Random(seed).randrange), taken from one seed per depth, so
    that a compiled forward has one variant per depth rather than one per step."""
    depths = range(rvq.quantize_dropout_cutoff_index, rvq.num_quantizers)
    return depth_seeds(depths.start, depths.stop)[random.Random(seed).randrange(depths.start, depths.stop)]


class CompiledStep:
    """A codec's compiled training forward, `forward(features, keep, beam_size, dropout_seed)`, called with the
    variants (input shape, dropout seed) it has run with counted. cuda_graphs: the first call of a graph under
    CUDA graphs runs it twice, a warm-up and then the capture's replay, so the library's codebook updates inside
    the graph would land twice in that step. That call is made first, its outputs dropped and the quantizer put
    back as it was (the codec's `codebook_state`): the step's own call is then one replay."""

    def __init__(self, codec: torch.nn.Module, forward: Callable, cuda_graphs: bool = False):
        self.codec, self.forward, self.cuda_graphs = codec, forward, cuda_graphs
        self.variants = set()

    def __call__(self, features: torch.Tensor, keep: torch.Tensor | None, seed: int | None):
        variant = (tuple(features.shape), seed)
        if self.cuda_graphs and variant not in self.variants:
            state = self.codec.codebook_state()
            self.forward(features, keep, 1, seed)
            self.codec.restore_codebook_state(state)
        self.variants.add(variant)
        return self.forward(features, keep, 1, seed)

    def compiles(self, features: torch.Tensor, seed: int | None) -> bool:
        """Whether a call with these features and dropout seed compiles a graph: its first."""
        return (tuple(features.shape), seed) not in self.variants


def graphs_and_breaks() -> tuple[int, int]:
    """Graphs dynamo has captured in this process, and graph breaks it has met: their differences across a compile
    say what it made (one graph and no break, but for quantize dropout's depth branch)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def require_grad_as_training_does(rvq: torch.nn.Module) -> None:
    """Each level's `zero` buffer (the loss a level returns without a commitment term) made to require grad, as the
    library's training forward makes it (`loss.requires_grad_()`), a call dynamo cannot trace: where the buffer
    does not yet require grad, the compiled forward breaks there into several graphs, which round otherwise than
    the one graph. A run that trained from scratch has it set by the k-means init's eager forwards; a resumed run
    skips those, so it is set here, before the first compiled call."""
    for level in rvq.layers:
        zero = getattr(level, "zero", None)
        if isinstance(zero, torch.Tensor) and zero.is_floating_point():
            zero.requires_grad_()


def compile_step(codec: torch.nn.Module, forward: Callable, mode: str = "default", variants: int = 1) -> CompiledStep:
    """`forward` (the codec's training forward, and so its backward) under torch.compile, one graph per input shape
    (static shapes: one per segment length) and per quantize-dropout depth; `variants`: how many such shapes the
    run may need. mode: "default" (torch.compile's) or "cudagraphs" (CUDA_GRAPH_OPTIONS, on CUDA)."""
    rvq = codec.rvq
    needed = variants * (rvq.num_quantizers if rvq.quantize_dropout else 1)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, needed)
    if mode not in ("default", "cudagraphs"):
        raise ValueError(f"compile mode {mode!r}: default or cudagraphs")
    cuda_graphs = mode == "cudagraphs"
    require_grad_as_training_does(rvq)
    options = CUDA_GRAPH_OPTIONS if cuda_graphs else COMPILE_OPTIONS.get(codec.feature_mean.device.type)
    # torch.compile takes a mode or options, not both: options alone compile in the default mode
    settings = {"options": options} if options else {}
    return CompiledStep(codec, torch.compile(forward, dynamic=False, **settings), cuda_graphs)
