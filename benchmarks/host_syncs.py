"""Host synchronisations of one training step, counted on any device with a CUDA-free proxy.

A sync is an op whose result the host must read before it can go on: a tensor read as a
Python number (`.item()`, `bool()`, `float()`, `if t:`), or an op whose output shape depends on
the data (nonzero, masked_select, unique). On CUDA each waits for the GPU to drain its queue.
`count_host_syncs()` records every such op seen by a TorchDispatchMode with the source line that
asked for it, so the CPU counts are the GPU counts; on a GPU `torch.cuda.set_sync_debug_mode`
confirms them (benchmarks/gpu_smoke.py). It also counts every op dispatched, by whose code asked
for it: each is host work (on a GPU most are a kernel launch), so where a step is bound by the host,
that count is its cost.

    python -m benchmarks.host_syncs [--crops 4 --frames 256 --foreach] [--compile]
        # one step of the default codec: syncs by source line, ops by owner

With --compile the training forward and backward run as the trainer runs them under `--compile on`
(torch.compile, one graph): the ops a compiled step dispatches are inductor's kernels (each launched once a
step; counted as generated) plus the library calls its graphs make (matrix products, convolutions) and what
runs outside the graph (the optimizer, the step decision), which the dispatch counter sees as in eager.
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


def moves_data(func) -> bool:
    """Whether a dispatched op does work on a device (on a GPU, a kernel launch): not a view of its input, not
    a profiler's marker."""
    return not (func.is_view or func is torch.ops.aten._unsafe_view.default or func.namespace == "profiler")


class HostSyncCounter(TorchDispatchMode):
    def __init__(self, count_ops: bool = False):
        super().__init__()
        self.by_caller: collections.Counter = collections.Counter()
        # with count_ops, every op dispatched, syncs or not, by owner (a stack walk per op: slow), and those of
        # them that move data (moves_data)
        self.ops_by_owner: collections.Counter = collections.Counter()
        self.data_ops = 0
        self.count_ops = count_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.count_ops:
            self.ops_by_owner[_owner()] += 1
            self.data_ops += moves_data(func)
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


GRAPH_CALL = "## Call CompiledFxGraph"  # the profiler's event for one run of an inductor graph


def _ancestors(event):
    event = event.cpu_parent
    while event is not None:
        yield event
        event = event.cpu_parent


def _is_sync(event) -> bool:
    return event.name.startswith("aten::") and event.name[6:] in SYNC_OPS | {"item"}


def profiled_ops(step) -> dict:
    """Run `step()` under torch.profiler and count, the same way eager and compiled: the ops the host issues
    (each aten op called from Python or from autograd, not the ops inside it; each kernel or library call an
    inductor graph makes) and the host syncs among them (torch.optim's reads of its host-side step counters
    left out, as above). A TorchDispatchMode cannot see inside a compiled graph (torch.compile runs eager
    while one is active), the profiler can (inductor's C++ kernels are recorded with
    `cpp.enable_kernel_profile`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops, syncs = collections.Counter(), collections.Counter()
    for event in prof.events():
        parents = list(_ancestors(event))
        if event.cpu_parent is not None and event.cpu_parent.name.startswith(GRAPH_CALL):
            ops["compiled graphs (inductor kernels and library calls)"] += 1
        elif event.name.startswith("aten::") and not any(p.name.startswith(("aten::", GRAPH_CALL)) for p in parents):
            ops["backward" if any(p.name.startswith("autograd::engine") for p in parents) else "eager"] += 1
        if _is_sync(event) and not any(_is_sync(p) or p.name.startswith("Optimizer.") for p in parents):
            syncs[event.name] += 1  # the outermost: .item() calls _local_scalar_dense
    return {"ops": sum(ops.values()), "ops_by_kind": dict(ops), "syncs": sum(syncs.values()),
            "syncs_by_op": dict(syncs)}


def step_report(model, x: torch.Tensor, optimizer, scaler, compiled: bool = False, kernel_profile: bool = True) -> dict:
    """One training step of `model` (the k-means init done first), eager or compiled as the trainer compiles it
    (`--compile on`): syncs by source line and ops by owner from the dispatch counter (eager only: a dispatch
    mode turns torch.compile off), and ops and syncs from the profiler (both). kernel_profile: the compiled
    graphs' C++ kernels recorded too (their op count; inductor's option, set only for this call: its graphs are
    compiled anew). Without it the profiler's syncs are the same (a sync is an aten op, never a kernel)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.enable_kernel_profile": kernel_profile}):
        return _step_report(model, x, optimizer, scaler, compiled)


def _step_report(model, x: torch.Tensor, optimizer, scaler, compiled: bool) -> dict:
    from data.bad_crops import finite_crops
    from training.step_guard import guarded_step

    def step():
        out = model(x, finite_crops(x))
        scaler.scale(out.loss).backward()
        scaler.unscale_(optimizer)
        guarded_step(scaler, optimizer, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.zero_grad(set_to_none=True)

    model.train()
    model.init_codebooks(x, batch_frames=x.shape[0] * x.shape[1])  # as the trainer, before the first step
    report = {"compiled": compiled, "threads": torch.get_num_threads()}
    if compiled:
        model.compile_training()
        start = time.perf_counter()
        step()  # compiles the forward and the backward
        report["compile_s"] = round(time.perf_counter() - start, 1)
    else:
        for _ in range(2):
            model_syncs, step_syncs, _ = one_step_syncs(model, x, optimizer, scaler)
        model_ops, step_ops, _ = one_step_syncs(model, x, optimizer, scaler, count_ops=True)
        report.update(syncs_model=model_syncs.total, syncs_step=step_syncs.total,
                      syncs_by_caller=dict((model_syncs.by_caller + step_syncs.by_caller).most_common()),
                      dispatched_ops=sum((model_ops.ops_by_owner + step_ops.ops_by_owner).values()),
                      dispatched_ops_by_owner=dict((model_ops.ops_by_owner + step_ops.ops_by_owner).most_common()))
    step()
    start = time.perf_counter()
    step()
    report["step_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    report["profiler"] = profiled_ops(step)
    return report


def main() -> None:
    import argparse
    import json

    from models.codec import CodecConfig, RVQCodec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crops", type=int, default=4, help="crops per step")
    parser.add_argument("--frames", type=int, default=256, help="frames per crop")
    parser.add_argument("--foreach", action="store_true",
                        help="the optimizer's multi-tensor path instead of the trainer's fused one")
    parser.add_argument("--compile", action="store_true", help="also the compiled step (--compile on)")
    parser.add_argument("--out", default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    reports = []
    for compiled in (False, True) if args.compile else (False,):
        torch.manual_seed(0)
        model = RVQCodec(CodecConfig(feature_dim=160))
        # the trainer's optimizer: AdamW fused into one kernel (rvq_seamless_gpu_cache_nccl.Trainer.build)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=None if args.foreach else True,
                                      foreach=True if args.foreach else None)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        x = torch.randn(args.crops, args.frames, 160)  # [batch, frames, dim]
        report = step_report(model, x, optimizer, scaler, compiled=compiled)
        reports.append(report)
        prof = report["profiler"]
        name = f"compiled (in {report['compile_s']} s)" if compiled else "eager"
        print(f"{name}: one step of {args.crops} x {args.frames} frames ({report['step_ms']:.0f} ms on "
              f"{report['threads']} CPU thread(s)): {prof['ops']} ops issued by the host {prof['ops_by_kind']}, "
              f"{prof['syncs']} host syncs {prof['syncs_by_op']} (profiler)")
        if not compiled:
            print(f"  dispatch counter: {report['syncs_model']} host syncs in the model, {report['syncs_step']} in "
                  f"the trainer's step, by source line:")
            for where, n in report["syncs_by_caller"].items():
                print(f"  {n:4d}  {where}")
            print(f"  {report['dispatched_ops']} ops dispatched (on a GPU most are a kernel launch), by whose code:")
            for owner, n in report["dispatched_ops_by_owner"].items():
                print(f"  {n:4d}  {owner}")
    if args.out:
        from benchmarks.demo_run import machine

        Path(args.out).write_text(json.dumps({"machine": machine(), "torch": torch.__version__, "crops": args.crops,
                                              "frames": args.frames, "steps": reports}, indent=2) + "\n")


if __name__ == "__main__":
    main()
