"""Host synchronisations of one training step, counted on any device with a CUDA-free proxy.

A sync is an op whose result the host must read before it can go on: a tensor read as a
Python number (`.item()`, `bool()`, `float()`, `if t:`), or an op whose output shape depends on
the data (nonzero, masked_select, unique). On CUDA each waits for the GPU to drain its queue.
`count_host_syncs()` records every such op seen by a TorchDispatchMode with the source line that
asked for it, so the CPU counts are the GPU counts; on a GPU `torch.cuda.set_sync_debug_mode`
confirms them (benchmarks/gpu_smoke.py). It also counts every op dispatched, by whose code asked
for it: each is host work (on a GPU most are a kernel launch), so where a step is bound by the host,
that count is its cost.

    python -m benchmarks.host_syncs [--crops 4 --frames 256 --foreach]
        # one step of the default codec: syncs by source line, ops by owner
"""
from __future__ import annotations

import collections
import contextlib
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim"}
REPO = Path(__file__).resolve().parents[1]


def _caller() -> str:
    """The innermost frame outside torch: the line of our code or of a library that asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("host_syncs.py"):
            continue
        if "vector_quantize_pytorch" in path:
            return f"vector_quantize_pytorch/{path.split('vector_quantize_pytorch/')[-1]}:{frame.lineno} {frame.name}"
        try:
            return f"{Path(path).resolve().relative_to(REPO)}:{frame.lineno} {frame.name}"
        except ValueError:
            return f"{path}:{frame.lineno} {frame.name}"
    return "torch"


def _in_optimizer() -> bool:
    """torch.optim reads its step counters with .item(): they live on the host even in a CUDA run
    (unless capturable or fused), so those reads are no device sync."""
    return any("/torch/optim/" in f.filename.replace("\\", "/") for f in traceback.extract_stack())


def _owner() -> str:
    """Whose code dispatched the op: the innermost frame that is not torch's or a tensor-notation helper's,
    backward and the optimizer (with gradient clipping) named as such."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path and frame.name in ("_engine_run_backward", "backward"):
            return "autograd (backward)"
        if "/torch/optim/" in path or "/torch/nn/utils/clip_grad" in path:
            return "torch.optim and clip_grad_norm_"
        if "vector_quantize_pytorch" in path:
            return "vector-quantize-pytorch (forward)"
        if not any(part in path for part in ("/torch/", "/einx/", "/einops/", "host_syncs.py")):
            return "this repo (forward, step decision)"
    return "torch"


class HostSyncCounter(TorchDispatchMode):
    def __init__(self, count_ops: bool = False):
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()
        # with count_ops, every op dispatched, syncs or not, by owner (a stack walk per op: slow)
        self.ops_by_owner: collections.Counter = collections.Counter()
        self.count_ops = count_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.count_ops:
            self.ops_by_owner[_owner()] += 1
        if func.__name__.split(".")[0] in SYNC_OPS and not _in_optimizer():
            self.by_caller[_caller()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_caller.values())


@contextlib.contextmanager
def count_host_syncs(count_ops: bool = False):
    counter = HostSyncCounter(count_ops)
    with counter:
        yield counter


def one_step_syncs(model, x: torch.Tensor, optimizer, scaler,
                   count_ops: bool = False) -> tuple[HostSyncCounter, HostSyncCounter, float]:
    """(the model's forward and backward, the trainer's step decision, seconds of the step): the
    forward as train_step calls it (with the finite-crop mask of data/bad_crops.py), then the trainer's own
    part, clip_grad_norm_ and training/step_guard.guarded_step. count_ops: also count every op (the
    seconds then include the counting)."""
    from data.bad_crops import finite_crops
    from training.step_guard import guarded_step

    start = time.perf_counter()
    with count_host_syncs(count_ops) as model_syncs:
        out = model(x, finite_crops(x))
        scaler.scale(out.loss).backward()
    with count_host_syncs(count_ops) as step_syncs:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guarded_step(scaler, optimizer, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return model_syncs, step_syncs, time.perf_counter() - start


def main() -> None:
    import argparse

    from models.codec import CodecConfig, RVQCodec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crops", type=int, default=4, help="crops per step")
    parser.add_argument("--frames", type=int, default=256, help="frames per crop")
    parser.add_argument("--foreach", action="store_true",
                        help="the optimizer's multi-tensor path, torch's default on CUDA (on a CPU it steps "
                             "one parameter at a time)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=160))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.foreach or None)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(args.crops, args.frames, 160)  # [batch, frames, dim]
    for step in range(3):  # the first step may run the k-means init: report a later one
        model_syncs, step_syncs, seconds = one_step_syncs(model, x, optimizer, scaler)
    print(f"one step ({seconds * 1e3:.0f} ms on {torch.get_num_threads()} CPU thread(s)): "
          f"{model_syncs.total} host syncs in the model, {step_syncs.total} in the trainer's step")
    for where, n in (model_syncs.by_caller + step_syncs.by_caller).most_common():
        print(f"  {n:4d}  {where}")
    model_ops, step_ops, _ = one_step_syncs(model, x, optimizer, scaler, count_ops=True)
    ops = model_ops.ops_by_owner + step_ops.ops_by_owner
    print(f"{sum(ops.values())} ops dispatched (on a GPU most are a kernel launch), by whose code asked:")
    for owner, n in ops.most_common():
        print(f"  {n:4d}  {owner}")


if __name__ == "__main__":
    main()
