"""Which of data/audio/w2v_attention.py's kernels a run's w2v-BERT computes with.

On a GPU, each candidate that runs here (GPU_CANDIDATES: transformers' stock module among them, so a run is never
slower than stock) is checked against the gathered bias (exact SDPA with the bias in its mask) and timed once on
the run's own pass shapes (pass_shapes: the longest chunks and chunks a third as long, each pass full, as it is
and with its last row half padded); the fastest that agrees is used. The choice and its timings are logged and
cached in cache_file() per device name, dtype, torch version, attention layout and pass shapes, so that the next
process (the next shard, tools.tokenize after tools.extract) neither times again nor computes with another kernel.
On a CPU the folded kernel, untimed: it made long chunks cheap there (benchmarks/README.md, "w2v-BERT's
attention").

A kernel is part of a shard's settings (tools/audio_shard.py): kernels differ in their last bits.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from data.audio import w2v_attention
from data.audio.w2v_attention_triton import triton_available
from data.dump_writer import cache_folder, write_temporary
from data.transfers import dtype_name

log = logging.getLogger(__name__)

# the kernels timed on a GPU, in the order they are tried (a tie goes to the first)
GPU_CANDIDATES = ("triton", "stock", "gather", "flex")
# timed passes of each candidate on each shape (after one untimed), the median kept
TIMED_PASSES = 5
CACHE_NAME = "w2v_attention_kernels.json"


@dataclasses.dataclass
class Choice:
    """The kernel chosen, with what was measured: seconds per candidate (the sum over the shapes of each shape's
    median pass of one layer's attention), and why each other candidate was left out."""

    kernel: str
    seconds: dict[str, float]
    failed: dict[str, str]
    cached: bool = False

    def describe(self) -> str:
        timed = ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        left_out = "".join(f"; {k} left out: {why}" for k, why in self.failed.items())
        return f"{self.kernel} (one layer's attention over the run's pass shapes: {timed}{left_out})"


def cpu_kernel() -> str:
    """The kernel on a CPU: the folded bias, where this torch's fused CPU attention returns its log-sum-exp."""
    return "fold" if w2v_attention._cpu_attention_with_lse() is not None else "gather"


def unavailable(kernel: str, device: torch.device) -> str | None:
    """Why `kernel` cannot run on `device`, or None where it can."""
    if kernel in ("stock", "gather"):
        return None
    if kernel == "fold":
        if device.type != "cpu":
            return "it runs on a CPU only"
        return None if w2v_attention._cpu_attention_with_lse() is not None else \
            "this torch's fused CPU attention returns no log-sum-exp"
    if kernel == "triton":
        return None if triton_available(device) else "Triton runs on CUDA (or a CPU under TRITON_INTERPRET=1)"
    if kernel == "flex":
        if device.type == "cuda" and w2v_attention.compiled_flex_attention() is None:
            return "flex attention is unavailable or failed to compile here"
        return None
    return f"no kernel is named {kernel!r}"


def pass_shapes(batch_frames: int, chunk_frames: int) -> list[tuple[int, int, bool]]:
    """(rows, frames, last row half padded) of the passes a run makes most: chunks of the longest length
    (`chunk_frames`), and a third as long, as many rows as `batch_frames` of padded frames hold; each as it is and
    padded."""
    shapes = []
    for frames in sorted({max(1, chunk_frames), max(1, chunk_frames // 3)}, reverse=True):
        rows = max(1, batch_frames // frames)
        shapes += [(rows, frames, False), (rows, frames, True)]
    return shapes


def cache_file() -> Path:
    """$XDG_CACHE_HOME (or ~/.cache)/rvq_seamless/w2v_attention_kernels.json."""
    return cache_folder() / CACHE_NAME


def cache_key(device: torch.device, dtype: torch.dtype, attention, shapes) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    layout = f"{attention.num_heads} heads of {attention.head_size}, left {attention.left} right {attention.right}"
    passes = ", ".join(f"{rows} x {frames}" for rows, frames, padded in shapes if not padded)
    return f"{name} | {dtype_name(dtype)} | torch {torch.__version__} | {layout} | passes {passes}"


def choose_kernel(encoder, shapes: list[tuple[int, int, bool]], *, path: Path | None = None,
                  timer: Callable | None = None) -> Choice:
    """The fastest GPU_CANDIDATES kernel for `encoder` (a data/audio/features.py W2vBertLayer) on `shapes`: read
    from the cache, else measured (`timer(encoder, kernel, inputs) -> seconds`, time_kernel by default) and
    cached. Processes choosing at once take turns (a lock beside the cache), so the later ones read the first's
    choice."""
    path = cache_file() if path is None else path
    key = cache_key(encoder.device, encoder.dtype, encoder.attentions[0], shapes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a+")
    except OSError as e:  # a read-only or missing home: measured for this process alone
        log.warning("the attention kernel's choice cannot be cached in %s (%s): measured for this process", path, e)
        return measure(encoder, shapes, timer or time_kernel)
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        cached = read_cache(path).get(key)
        if isinstance(cached, dict) and unavailable(cached.get("kernel", "?"), encoder.device) is None:
            return Choice(cached["kernel"], cached.get("seconds", {}), cached.get("failed", {}), cached=True)
        choice = measure(encoder, shapes, timer or time_kernel)
        entries = read_cache(path)
        entries[key] = {"kernel": choice.kernel, "seconds": choice.seconds, "failed": choice.failed,
                        "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.replace(write_temporary(path, json.dumps(entries, indent=1) + "\n"), path)
        except OSError as e:  # a full or read-only disk: the choice holds for this process
            log.warning("the attention kernel's choice could not be cached in %s (%s)", path, e)
    return choice


def read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def measure(encoder, shapes: list[tuple[int, int, bool]], timer: Callable) -> Choice:
    """Every candidate that runs here, checked against the gathered bias on each shape's inputs, then timed.
    transformers' own module where the reference itself cannot run (no memory for it, say) or no candidate
    agrees."""
    seconds, failed = {}, {}
    try:
        inputs = [attention_inputs(encoder, shape) for shape in shapes]
        reference = [run(encoder, "gather", call) for call in inputs]
    except Exception as e:  # noqa: BLE001 - nothing to check the candidates against: stock, untimed
        log.warning("the attention kernels could not be checked on the run's pass shapes (%s: %s); w2v-bert keeps "
                    "transformers' attention", type(e).__name__, _last_line(e))
        return Choice("stock", seconds, {"gather": f"{type(e).__name__}: {_last_line(e)}"})
    for kernel in GPU_CANDIDATES:
        why = unavailable(kernel, encoder.device)
        if why is None:
            why = disagreement(encoder, kernel, inputs, reference)
        if why is not None:
            failed[kernel] = why
            continue
        seconds[kernel] = timer(encoder, kernel, inputs)
    if not seconds:
        return Choice("stock", seconds, failed)
    fastest = min(seconds, key=lambda k: (seconds[k], GPU_CANDIDATES.index(k)))
    return Choice(fastest, seconds, failed)


def _last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1][:200] if lines else ""


def attention_inputs(encoder, shape: tuple[int, int, bool]) -> tuple[tuple, dict]:
    """(args, kwargs) of the first encoder layer's attention in a pass of `shape` (random fbank): the hidden
    states and the mask as this transformers passes them."""
    rows, frames, padded = shape
    generator = torch.Generator().manual_seed(rows * 100_003 + frames)
    lengths = [frames] * rows
    if padded:
        lengths[-1] = max(1, frames // 2)
    chunks = [torch.randn(n, 160, generator=generator).numpy() for n in lengths]
    captured = []

    def capture(module, args, kwargs):
        captured.append((args, kwargs))
        raise _Captured

    handle = encoder.attentions[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        encoder.hidden(chunks)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured[0]


class _Captured(Exception):
    """The pass is stopped once the first attention's inputs are captured."""


def run(encoder, kernel: str, call: tuple[tuple, dict]) -> torch.Tensor:
    attention = encoder.attentions[0]
    previous = attention.kernel
    attention.kernel = kernel
    try:
        with torch.inference_mode():
            return attention(*call[0], **call[1])[0]
    finally:
        attention.kernel = previous


def disagreement(encoder, kernel: str, inputs: list, reference: list) -> str | None:
    """Why `kernel` is not used (it failed, or its output is further from the gathered bias than the dtype's
    tolerance on some shape), or None."""
    tolerance = w2v_attention.PROBE_TOLERANCE.get(encoder.dtype, 2e-2)
    for call, want in zip(inputs, reference, strict=True):
        try:
            got = run(encoder, kernel, call)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is left out, and said why
            return f"{type(e).__name__}: {_last_line(e)}"
        if kernel == "flex" and w2v_attention.compiled_flex_attention() is None:
            return "flex attention failed its probe here"
        error = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
        if not error <= tolerance:
            rows, frames = (call[0][0] if call[0] else call[1]["hidden_states"]).shape[:2]
            return f"{rows} x {frames} frames differ from the gathered bias by {error:.1e} relative"
    return None


def time_kernel(encoder, kernel: str, inputs: list) -> float:
    """Seconds of one layer's attention with `kernel`: each shape's median of TIMED_PASSES (after one untimed),
    summed over the shapes (device time through CUDA events on a GPU)."""
    total = 0.0
    for call in inputs:
        run(encoder, kernel, call)
        times = []
        for _ in range(TIMED_PASSES):
            if encoder.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(encoder, kernel, call)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                began = time.perf_counter()
                run(encoder, kernel, call)
                times.append(time.perf_counter() - began)
        total += float(np.median(times))
    return total
