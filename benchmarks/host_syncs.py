"""Host synchronisations of one training step, counted on any device with a CUDA-free proxy.

A sync is an op whose result the host must read before it can go on: a tensor read as a
Python number (`.item()`, `bool()`, `float()`, `if t:`), or an op whose output shape depends on
the data (nonzero, masked_select, unique). On CUDA each waits for the GPU to drain its queue.
`count_host_syncs()` records every such op seen by a TorchDispatchMode with the source line that
asked for it, so the CPU counts are the GPU counts; on a GPU `torch.cuda.set_sync_debug_mode`
confirms them (benchmarks/gpu_smoke.py).

    python -m benchmarks.host_syncs      # one step of the default codec: syncs by source line
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


class HostSyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNC_OPS and not _in_optimizer():
            self.by_caller[_caller()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_caller.values())


@contextlib.contextmanager
def count_host_syncs():
    counter = HostSyncCounter()
    with counter:
        yield counter


def one_step_syncs(model, x: torch.Tensor, optimizer, scaler) -> tuple[HostSyncCounter, HostSyncCounter, float]:
    """(the model's forward and backward, the trainer's step decision, seconds of the step): the
    forward as train_step calls it (with the finite-crop mask of data/bad_crops.py), then the trainer's own
    part, clip_grad_norm_ and training/step_guard.guarded_step."""
    from data.bad_crops import finite_crops
    from training.step_guard import guarded_step

    start = time.perf_counter()
    with count_host_syncs() as model_syncs:
        out = model(x, finite_crops(x))
        scaler.scale(out.loss).backward()
    with count_host_syncs() as step_syncs:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guarded_step(scaler, optimizer, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return model_syncs, step_syncs, time.perf_counter() - start


def main() -> None:
    from models.codec import CodecConfig, RVQCodec

    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=160))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(4, 256, 160)  # [batch, frames, dim]
    for step in range(3):  # the first step may run the k-means init: report a later one
        model_syncs, step_syncs, seconds = one_step_syncs(model, x, optimizer, scaler)
    print(f"one step ({seconds * 1e3:.0f} ms on {torch.get_num_threads()} CPU thread(s)): "
          f"{model_syncs.total} host syncs in the model, {step_syncs.total} in the trainer's step")
    for where, n in (model_syncs.by_caller + step_syncs.by_caller).most_common():
        print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main()
