"""The first run on a GPU machine: every CUDA path of the trainer, in order of what it proves per minute.

Each step prints one line, PASS, FAIL or SKIP, with its figure (or the reason it was skipped), and the
whole run is written to benchmarks/results/gpu_smoke_<device>.json. Steps that need CUDA say SKIP with
the reason on a machine without it; --cpu-only runs only what a CPU can check (the test suite does).

    bash benchmarks/gpu_smoke.sh [WHEEL_DIR]       # installs what is missing, then runs this
    python benchmarks/gpu_smoke.py [--cpu-only] [--only NAME ...] [--steps 120]

Exit code: 0 when no step failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.presets import PRESETS  # noqa: E402 - after the repo is on the path
from training.metrics_log import run_events as events  # noqa: E402
from training.run_folder import RunFolder  # noqa: E402

TRAINER = [sys.executable, str(REPO / "rvq_seamless_gpu_cache_nccl.py")]
# fp32 losses under --deterministic against the host path's, relative: the prefetcher and the device cache
# (fp32 under --precision fp32) give the same batches, so the same losses
LOSS_RTOL = {"prefetch": 1e-5, "cache": 1e-5}
# stop and resume without --deterministic: the GPU's unordered reductions (atomics) make two unbroken runs
# differ too, and k-means and dead-code re-seeding amplify that into different codes, so weights are not
# comparable; the last logged loss is, within this relative tolerance
RESUME_LOSS_RTOL = 0.05
DRILL_KERNEL_S = 30  # one GPU: the kernel the drill's collective waits behind
# compiled (--compile on, cudagraphs) against eager: fp32 losses of the first steps under --deterministic, relative.
# The first step is the same arithmetic with sums reordered (an H100 run: 1e-7); later steps train on what the
# earlier left, and a code picked differently on a near tie grows the gap step by step (4e-3 by step 20 on an H100
# for --compile on; benchmarks/README.md). A codebook update applied twice shows at the first step (1e-4).
COMPILED_FIRST_LOSS_RTOL = 1e-5
COMPILED_LOSS_RTOL = 1e-2
COMPILED_LOSS_STEPS = 20
LARGE_BATCH = 512  # crops a step: README "Measured" reasons that twice the plain loop needs some 600-700
W2V_MIN_COSINE = 0.99  # bf16 against fp32 features of a random w2v-BERT, per frame


class Skip(Exception):
    """The step cannot run here; the message says why."""


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("needs CUDA: no GPU visible")


def run(cmd, *, env=None, timeout=900, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def last_weights(out_dir: Path) -> dict:
    last = sorted(RunFolder(out_dir).checkpoints.glob("*.pt"), key=lambda p: p.stat().st_mtime)[-1]
    return torch.load(last, map_location="cpu", weights_only=False)["model"]


def max_weight_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].is_floating_point() else
               float((a[k] != b[k]).any()) for k in a)


# ---- the steps: each returns (passed, figure, details)

def step_versions(args):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpus"] = torch.cuda.device_count()
    try:
        import vector_quantize_pytorch  # noqa: F401
        from importlib.metadata import version
        info["vector_quantize_pytorch"] = version("vector-quantize-pytorch")
    except ImportError:
        return False, "vector-quantize-pytorch is missing: give gpu_smoke.sh a wheel folder", info
    return True, ", ".join(f"{k} {v}" for k, v in info.items()), info


def step_doctor(args):
    out = run([sys.executable, "-m", "tools.doctor"], timeout=300)
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
    return out.returncode == 0, f"exit {out.returncode}: {tail[0]}", {"output": (out.stdout + out.stderr)[-4000:]}


def step_host_syncs(args):
    """The trainer's own host syncs per step, and an encode's (CPU proxy; on CUDA also
    torch.cuda.set_sync_debug_mode)."""
    import warnings

    from benchmarks.host_syncs import count_host_syncs, one_step_syncs
    from models.codec import CodecConfig, RVQCodec

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_only else "cpu")
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=160)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    x = torch.randn(4, 256, 160, device=device)
    for _ in range(3):  # past the k-means init
        model_syncs, step_syncs, seconds = one_step_syncs(model, x, optimizer, scaler)
    details = {"trainer": step_syncs.total, "library": dict(model_syncs.by_caller), "step_s": seconds}
    model_ops, step_ops, _ = one_step_syncs(model, x, optimizer, scaler, count_ops=True)
    details["ops_by_owner"] = dict(model_ops.ops_by_owner + step_ops.ops_by_owner)  # host work per step
    if device.type == "cuda":  # the driver's own count: every sync warns once
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            one_step_syncs(model, x, optimizer, scaler)
        torch.cuda.set_sync_debug_mode(0)
        details["cuda_sync_warnings"] = len(caught)
    # the encode of tools.encode and tools.tokenize, at the codec's beam: on CUDA nothing read back (F.one_hot's
    # bound checks, which the CPU proxy counts, are made on a CPU only)
    model.eval()
    with torch.no_grad(), count_host_syncs() as encode_syncs:
        model.encode(x, beam_size=model.config.beam_size)
    details["encode_syncs_cpu_proxy"] = dict(encode_syncs.by_caller)
    encode_ok = True
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.encode(x, beam_size=model.config.beam_size)
        torch.cuda.set_sync_debug_mode(0)
        details["encode_cuda_sync_warnings"] = len(caught)
        encode_ok = not caught
    figure = (f"{step_syncs.total} in the trainer's step, {model_syncs.total} in the library ({device}, "
              f"{seconds * 1e3:.0f} ms); encode: {details.get('encode_cuda_sync_warnings', encode_syncs.total)}")
    return step_syncs.total == 1 and encode_ok, figure, details


def open_demo(world_size=1):
    from data.training_data import DataConfig, open_training_data

    cfg = DataConfig()
    from training.device import select_device

    return cfg, open_training_data(cfg, rank=0, world_size=world_size, seed=0, multiple_of=1,
                                   device_type=select_device("auto").type)


def step_batch_equality(args):
    """Prefetcher and device cache (fully and partly cached) give the host path's batches, step by step."""
    import dataclasses

    from data.training_data import batch_source
    from training.device import cache_dtype

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_only else "cpu")
    cfg, data = open_demo()
    dtype = cache_dtype(device)
    gb = data.shard.total_frames * data.shard.dim * torch.finfo(dtype).bits / 8 / 1e9
    variants = {"host": dict(), "prefetch": dict(prefetch=True, num_workers=1),
                "cache (all)": dict(use_gpu_cache=True),
                "cache (half) + prefetch": dict(use_gpu_cache=True, gpu_cache_gb=gb / 2, prefetch=True, num_workers=1)}
    steps = min(args.steps, data.plan.steps_per_epoch)
    got = {}
    for name, flags in variants.items():
        source = batch_source(dataclasses.replace(cfg, **flags), data.shard, data.plan, device, start_step=0,
                              cache_dtype=dtype, show_progress=False)
        try:
            # a copy now: the sources reuse their buffers once the step is done with a batch
            got[name] = [source.get(i)[1].to("cpu", torch.float32, copy=True) for i in range(steps)]
        finally:
            getattr(source, "close", lambda: None)()
    # cached crops are stored in the cache's dtype, the rest come as the host gives them: each value must be
    # the host's, or the host's rounded to the cache's dtype
    diffs = {name: max(float(torch.minimum((a - b).abs(), (a.to(dtype).float() - b).abs()).max())
                       for a, b in zip(got["host"], batches))
             for name, batches in got.items() if name != "host"}
    return all(d == 0 for d in diffs.values()), f"{steps} steps, max |diff| {diffs} on {device} ({dtype})", diffs


def trainer_flags(out: Path, steps: int, *extra) -> list:
    return ["--output_dir", out, "--resume", "none", "--max_steps", steps, "--eval_every", max(1, steps // 2),
            "--save_every", max(1, steps // 2), "--log_every", 10, *extra]


def preset_run(preset: str, precision: str, multi: bool, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="smoke") as folder:
        out = Path(folder)
        extra = ["--precision", precision] + (["--multi_length_training"] if multi else [])
        began = time.perf_counter()
        job = run(["bash", "run_nccl_optimized.sh", preset, *trainer_flags(out, steps, *extra)],
                  env={"NPROC_PER_NODE": "1"})
        train = events(out, "train") if RunFolder(out).metrics.exists() else []
        ok = job.returncode == 0 and RunFolder(out).checkpoints.is_dir() and bool(train) and bool(events(out, "eval"))
        last = train[-1] if train else {}
        return {"ok": ok, "exit": job.returncode, "seconds": round(time.perf_counter() - began, 1),
                **{k: last.get(k) for k in ("frames_per_sec", "mfu", "data_wait_frac", "bad_steps")},
                **({} if ok else {"stderr": job.stderr[-3000:]})}


def step_presets(args):
    """Each preset for --steps steps with eval, refit and checkpoint, in bf16 and fp16, with and without
    --multi_length_training; --jobs runs at a time on the one GPU (their frames/s share it: the throughput
    figures come from the benchmarks step)."""
    needs_cuda()
    from concurrent.futures import ThreadPoolExecutor

    from data.demo_corpus import ensure_demo_corpus

    ensure_demo_corpus()
    runs = {f"{preset} {precision}{' multi-length' if multi else ''}": (preset, precision, multi)
            for preset in PRESETS for precision in ("bf16", "fp16") for multi in (False, True)}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(preset_run, *run_args, args.steps) for name, run_args in runs.items()}
        results = {name: future.result() for name, future in futures.items()}
    failed = [name for name, result in results.items() if not result.pop("ok")]
    return not failed, f"{len(results) - len(failed)}/{len(results)} runs passed, {args.jobs} at a time " \
                       f"{failed or ''}", results


SPEED: dict[tuple, dict] = {}  # trained_speed's runs in this process


def trained_speed(steps: int, *extra) -> dict:
    """One trainer run on the demo corpus from the device cache (the step's figures, not the host's batch
    assembly): frames/s over all its windows but the first (warm-up, CUDA graph capture: total frames / total
    time), with no eval, checkpoint or refit inside them, as in bench_train.py (data_wait_frac: the windows'
    mean); its compile time from the log. Kept per flags for this process: the "batch 512" step reuses what the
    "compiled step" step measured."""
    key = (steps, *map(str, extra))
    if key in SPEED:
        return SPEED[key]
    from benchmarks.bench_train import compile_seconds

    with tempfile.TemporaryDirectory(prefix="smoke") as folder:
        out = Path(folder)
        began = time.perf_counter()
        job = run([*TRAINER, "--output_dir", out, "--resume", "none", "--max_steps", steps, "--log_every", 10,
                   "--eval_every", 10 * steps, "--save_every", 10 * steps, "--refit_iters", 0, "--use_gpu_cache",
                   *extra])
        train = events(out, "train")[1:] if RunFolder(out).metrics.exists() else []
    result = {"exit": job.returncode, "seconds": round(time.perf_counter() - began, 1),
              "compile_seconds": compile_seconds(job.stderr)}
    if job.returncode == 0 and train:
        result.update(frames_per_sec=round(len(train) / sum(1 / e["frames_per_sec"] for e in train)),
                      data_wait_frac=round(sum(e["data_wait_frac"] for e in train) / len(train), 4),
                      mfu=round(sum(e["mfu"] for e in train) / len(train), 5),
                      segment_length=train[-1]["segment_length"], windows=len(train))
    else:
        result["stderr"] = job.stderr[-3000:]
    SPEED[key] = result
    return result


def first_losses(compile_flag: str) -> tuple[subprocess.CompletedProcess, list]:
    """The loss of each of the first COMPILED_LOSS_STEPS steps, fp32 under --deterministic, at --compile
    `compile_flag` (eager: two such runs give the same losses, so what differs is the compiler's)."""
    steps = COMPILED_LOSS_STEPS
    with tempfile.TemporaryDirectory(prefix="smoke") as out:
        job = run([*TRAINER, "--output_dir", out, "--resume", "none", "--max_steps", steps, "--log_every", 1,
                   "--eval_every", 10 * steps, "--save_every", 10 * steps, "--refit_iters", 0, "--precision", "fp32",
                   "--deterministic", "--compile", compile_flag])
        losses = [e["loss"] for e in events(Path(out), "train")] if job.returncode == 0 else []
    return job, losses


def compile_time(row: dict) -> str:
    seconds = row.get("compile_seconds")
    return "no compile time logged" if seconds is None else f"compiled in {seconds:.0f} s"


def relative_gap(losses: list, reference: list) -> float:
    """The largest relative difference step by step (a non-finite loss on either side: infinite)."""
    if len(losses) != len(reference):
        return float("inf")
    return max((abs(a - b) / abs(b) if a is not None and b is not None and b else float("inf")
                for a, b in zip(losses, reference)), default=float("inf"))


def step_compiled_step(args):
    """The training step compiled (--compile on) and with CUDA graphs (--compile cudagraphs) against eager
    (--compile off), at the default codec and GPU batch: frames/s of each at the default precision, with its
    compile time; and the fp32 losses of the first COMPILED_LOSS_STEPS steps under --deterministic, which must
    agree with eager's: the first within COMPILED_FIRST_LOSS_RTOL, all within COMPILED_LOSS_RTOL (relative)."""
    needs_cuda()
    flags = ("off", "on", "cudagraphs")
    steps = max(args.steps, 30)
    speed = {flag: trained_speed(steps, "--compile", flag) for flag in flags}
    losses, failed, stderr = {}, [], {}
    for flag in flags:
        job, losses[flag] = first_losses(flag)
        if job.returncode:
            failed.append(f"fp32 --compile {flag}: exit {job.returncode}")
            stderr[f"fp32 {flag}"] = job.stderr[-3000:]
    failed += [f"--compile {flag}: exit {r['exit']}" for flag, r in speed.items()
               if r["exit"] or "frames_per_sec" not in r]
    details = {"speed": speed, "losses": losses, "loss_rtol": COMPILED_LOSS_RTOL, **stderr}
    if failed:
        return False, "; ".join(failed), details
    compiled = ("on", "cudagraphs")
    first = {flag: relative_gap(losses[flag][:1], losses["off"][:1]) for flag in compiled}
    gaps = {flag: relative_gap(losses[flag], losses["off"]) for flag in compiled}
    details.update(first_loss_gap=first, loss_gap=gaps)
    eager = speed["off"]["frames_per_sec"]
    figure = ", ".join(f"--compile {flag} {r['frames_per_sec']:,} frames/s"
                       + ("" if flag == "off" else f" ({r['frames_per_sec'] / eager:.2f}x, {compile_time(r)})")
                       for flag, r in speed.items())
    figure += f"; fp32 losses against eager, first step / {COMPILED_LOSS_STEPS} steps: " + ", ".join(
        f"{flag} {first[flag]:.1e} / {gaps[flag]:.1e}" for flag in compiled) + \
        f" (tolerances {COMPILED_FIRST_LOSS_RTOL} / {COMPILED_LOSS_RTOL})"
    ok = all(first[flag] <= COMPILED_FIRST_LOSS_RTOL and gaps[flag] <= COMPILED_LOSS_RTOL for flag in compiled)
    return ok, figure, details


def step_batch_512(args):
    """Frames/s of the compiled step (--compile on) at LARGE_BATCH crops a step against the GPU's default batch
    (64 crops of 128 frames), and eager at LARGE_BATCH: whether a larger batch lifts a host-bound step's
    throughput (twice the plain loop's takes some 600-700 crops, README "Measured"). A measurement: it passes
    when the runs finish."""
    needs_cuda()
    steps = max(args.steps, 30)
    runs = {"compiled, default batch": ("--compile", "on"),
            f"compiled, {LARGE_BATCH} crops": ("--compile", "on", "--batch_size", LARGE_BATCH),
            f"eager, {LARGE_BATCH} crops": ("--compile", "off", "--batch_size", LARGE_BATCH)}
    results = {name: trained_speed(steps, *flags) for name, flags in runs.items()}
    failed = [f"{name}: exit {r['exit']}" for name, r in results.items() if r["exit"] or "frames_per_sec" not in r]
    if failed:
        return False, "; ".join(failed), results
    base, large, eager = (results[name] for name in runs)
    return True, f"compiled: {large['frames_per_sec']:,} frames/s at {LARGE_BATCH} crops, " \
                 f"{large['frames_per_sec'] / base['frames_per_sec']:.2f}x the default batch's " \
                 f"{base['frames_per_sec']:,}; eager at {LARGE_BATCH} crops: {eager['frames_per_sec']:,} " \
                 f"(data wait {large['data_wait_frac']:.1%}, compiled)", results


def step_optimizer(args):
    """Frames/s of the compiled step (--compile on) with `--optimizer muon` against the default AdamW, at 50 Hz
    (the defaults) and 25 Hz (--downsample 2): what Muon's extra kernels a step (benchmarks/bench_optimizer.py
    counts them) cost where the step is bound by the host. The default run is the "compiled step" step's own
    (trained_speed keeps it). A measurement: it passes when the runs finish."""
    needs_cuda()
    steps = max(args.steps, 30)
    codecs = {"50 Hz": (), "25 Hz": ("--downsample", "2")}
    optimizers = {"adamw": (), "muon": ("--optimizer", "muon")}  # AdamW is the default: no flag
    results = {f"{codec}, {optimizer}": trained_speed(steps, "--compile", "on", *codec_flags, *optimizer_flags)
               for codec, codec_flags in codecs.items() for optimizer, optimizer_flags in optimizers.items()}
    failed = [f"{name}: exit {r['exit']}" for name, r in results.items() if r["exit"] or "frames_per_sec" not in r]
    if failed:
        return False, "; ".join(failed), results
    speed = {name: r["frames_per_sec"] for name, r in results.items()}
    return True, ", ".join(f"{codec}: muon {speed[f'{codec}, muon']:,} frames/s, "
                           f"{speed[f'{codec}, muon'] / speed[f'{codec}, adamw']:.2f}x adamw's "
                           f"{speed[f'{codec}, adamw']:,}" for codec in codecs), results


def step_fp32_losses(args):
    needs_cuda()
    losses = {}
    for name, extra in {"host": [], "prefetch": ["--prefetch", "--num_workers", "1"],
                        "cache": ["--use_gpu_cache"]}.items():
        with tempfile.TemporaryDirectory(prefix="smoke") as out:
            job = run([*TRAINER, *trainer_flags(Path(out), 40, "--precision", "fp32", "--deterministic", *extra)])
            if job.returncode:
                return False, f"{name}: exit {job.returncode}", {"stderr": job.stderr[-3000:]}
            losses[name] = [e["loss"] for e in events(Path(out), "train")]
    worst = {name: max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["host"], strict=True))
             for name in LOSS_RTOL}
    return all(worst[n] <= LOSS_RTOL[n] for n in LOSS_RTOL), \
        "--deterministic, max relative loss difference to the host path: " + \
        ", ".join(f"{n} {worst[n]:.1e} (tolerance {LOSS_RTOL[n]})" for n in LOSS_RTOL), losses


def last_loss(out_dir: Path) -> float:
    return events(out_dir, "train")[-1]["loss"]


def step_resume(args):
    """Stopped by SIGTERM at step 20 and resumed: under --deterministic the same weights as an unbroken 40-step
    run; without it, the same last loss within RESUME_LOSS_RTOL (a second unbroken run shows the noise)."""
    needs_cuda()
    figures = {}
    for deterministic in (True, False):
        extra = ["--deterministic"] if deterministic else []
        with tempfile.TemporaryDirectory(prefix="smoke") as folder:
            a, b, c = (Path(folder) / name for name in ("whole", "resumed", "again"))
            flags = ["--max_steps", 40, "--save_every", 1000, "--eval_every", 1000, *extra]
            jobs = [run([*TRAINER, "--output_dir", a, *flags]),
                    run([*TRAINER, "--output_dir", b, *flags], env={"RVQ_FAULT": "signal:rank=0:step=20:sig=TERM"}),
                    run([*TRAINER, "--output_dir", b, *flags])]
            if not deterministic:
                jobs.append(run([*TRAINER, "--output_dir", c, *flags]))
            if any(job.returncode for job in jobs):
                return False, "a run failed", {"stderr": "".join(job.stderr for job in jobs)[-3000:]}
            key = "deterministic" if deterministic else "default"
            figures[key] = {"weight_diff": max_weight_diff(last_weights(a), last_weights(b)),
                            "loss_rdiff": abs(last_loss(b) / last_loss(a) - 1)}
            if not deterministic:
                figures[key]["unbroken_loss_rdiff"] = abs(last_loss(c) / last_loss(a) - 1)
                figures[key]["unbroken_weight_diff"] = max_weight_diff(last_weights(a), last_weights(c))
    det, default = figures["deterministic"], figures["default"]
    ok = det["weight_diff"] == 0 and default["loss_rdiff"] <= RESUME_LOSS_RTOL
    return ok, f"--deterministic: max |weight diff| {det['weight_diff']:.1e} (must be 0); default: last loss " \
               f"{default['loss_rdiff']:.1%} off (tolerance {RESUME_LOSS_RTOL:.0%}; two unbroken runs: " \
               f"{default['unbroken_loss_rdiff']:.1%})", figures


NCCL_SCRIPT = r"""
import datetime, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
control = dist.new_group(backend="gloo")
t = torch.ones(4, device="cuda")
dist.all_reduce(t); dist.broadcast(t, 0); dist.barrier()
gathered = [torch.empty_like(t)]; dist.all_gather(gathered, t)
objs = [None]; dist.all_gather_object(objs, {"step": 1}, group=control)
dist.monitored_barrier(group=control, timeout=datetime.timedelta(seconds=10))
model = DDP(torch.nn.Linear(4, 4).cuda())
with model.no_sync():
    model(t[None]).sum().backward()
model(t[None]).sum().backward()
from vector_quantize_pytorch import ResidualVQ
rvq = ResidualVQ(dim=16, num_quantizers=2, codebook_size=32, kmeans_init=True, threshold_ema_dead_code=2,
                 sync_codebook=True).cuda().train()
rvq(torch.randn(2, 64, 16, device="cuda"))
torch.cuda.synchronize()
print("collectives ok")
dist.destroy_process_group()
"""

DRILL_SCRIPT = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=5), device_id=torch.device("cuda", 0))
t = torch.ones(1, device="cuda")
dist.all_reduce(t); torch.cuda.synchronize()  # the communicator works
if dist.get_world_size() == 1:
    # one GPU: no peer can stay away, so the collective is queued behind a kernel that outlasts the timeout
    torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * float(os.environ["KERNEL_S"])))
if int(os.environ["RANK"]) == 0:
    dist.all_reduce(t)  # with two ranks, rank 1 never joins this one
print("collective enqueued", flush=True)
time.sleep(90)
sys.exit(0)  # reached only if the watchdog did not end the process
"""


def torchrun(script: str, nproc: int, out: Path, timeout: int, env=None):
    path = out / "script.py"
    path.write_text(script)
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(out / "nccl_trace_rank_"), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
           "PYTHONPATH": str(REPO), **(env or {})}
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", nproc, "--max_restarts", 0,
                path], env=env, timeout=timeout)


def step_nccl_one_rank(args):
    """One NCCL rank: the collectives, DDP no_sync, monitored_barrier, the quantizer's distributed k-means
    and dead-code expiry; then the trainer itself under torchrun with one rank."""
    needs_cuda()
    with tempfile.TemporaryDirectory(prefix="smoke") as out:
        job = torchrun(NCCL_SCRIPT, 1, Path(out), 300)
        if job.returncode or "collectives ok" not in job.stdout:
            return False, f"collectives: exit {job.returncode}", {"stderr": job.stderr[-3000:]}
        trainer = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 1, *TRAINER[1:],
                       *trainer_flags(Path(out) / "run", 40)], timeout=600)
    return trainer.returncode == 0, f"collectives ok; trainer under torchrun x1: exit {trainer.returncode}", \
        {"stderr": trainer.stderr[-3000:]}


def step_timeout_drill(args):
    """A collective that cannot finish under a 5 s timeout: the watchdog leaves a flight-recorder dump and ends
    the process. With two GPUs its peer never joins, and the process ends within a minute. With one, it waits
    behind a compute kernel of DRILL_KERNEL_S seconds (one rank has no peer to wait for); the dump must come
    within 30 s, but the process can only end when that kernel does (an abort cannot stop a running kernel,
    unlike NCCL's own kernel spinning for a lost peer)."""
    needs_cuda()
    nproc = 2 if torch.cuda.device_count() >= 2 else 1
    with tempfile.TemporaryDirectory(prefix="smoke") as out:
        began = time.time()
        job = torchrun(DRILL_SCRIPT, nproc, Path(out), 150, env={"KERNEL_S": str(DRILL_KERNEL_S)})
        seconds = time.time() - began
        dumps = list(Path(out).glob("nccl_trace_rank_*"))
        dumped = min((d.stat().st_mtime - began for d in dumps), default=float("inf"))
    output = job.stdout + job.stderr
    ends_by = 60 if nproc == 2 else DRILL_KERNEL_S + 60  # startup, the kernel, the abort
    ok = job.returncode != 0 and "collective enqueued" in output and "operation timeout" in output \
        and dumped < 30 and seconds < ends_by
    return ok, f"{nproc} rank(s): dump after {dumped:.0f} s (< 30), exit {job.returncode} after {seconds:.0f} s " \
               f"(< {ends_by})", {"seconds": seconds, "dump_s": dumped, "ranks": nproc, "output": output[-3000:]}


def step_benchmarks(args):
    """bench_data (the host side of batch assembly) and bench_train at the default codec and batch on the GPU,
    eager and compiled, against the plain DataLoader loop: with --use_gpu_cache and --compile on,
    data_wait_frac <= 1% and at least 2x its frames/s (the eager row's figures are reported beside it)."""
    needs_cuda()
    figures = {}
    for script, extra in (("bench_data.py", []),
                          ("bench_train.py", ["--device", "cuda", "--codec", "default", "--compile", "off,on",
                                              "--ours", "gpu_cache", "--repeats", 1])):
        out = REPO / "benchmarks" / "results" / f"gpu_{script.replace('.py', '.json')}"
        job = run([sys.executable, REPO / "benchmarks" / script, "--out", out, *extra], timeout=900)
        if job.returncode:
            return False, f"{script}: exit {job.returncode}", {"stderr": job.stderr[-3000:]}
        figures[script] = json.loads(out.read_text())
    runs = figures["bench_train.py"]["runs"]
    cache = {row["compile"]: row for name, row in runs.items() if name.startswith("ours: --use_gpu_cache (all")}
    compiled, eager = cache["on"], cache["off"]
    plain = max((row for name, row in runs.items() if name.startswith("plain")), key=lambda row: row["frames_per_sec"])
    ok = compiled["data_wait_frac"] <= 0.01 and compiled["vs_best_plain"] >= 2
    ceiling = plain["frames_per_sec_no_wait"] / plain["frames_per_sec"]  # the plain loop's step with no data wait
    return ok, f"--use_gpu_cache --compile on: {compiled['frames_per_sec']:,} frames/s, data wait " \
               f"{compiled['data_wait_frac']:.1%} (<= 1%), {compiled['vs_best_plain']}x the plain loop (>= 2x), " \
               f"MFU {compiled['mfu']:.1%}, {compile_time(compiled)}; eager: " \
               f"{eager['frames_per_sec']:,} frames/s, data wait {eager['data_wait_frac']:.1%}, " \
               f"{eager['vs_best_plain']}x; a perfect data path at this batch: {ceiling:.2f}x the plain loop; " \
               "benchmarks/results/gpu_bench_*.json", figures


def step_w2v_bert_bf16(args):
    """A tiny random w2v-BERT's features in bf16 against fp32: per-frame cosine and relative MSE."""
    import numpy as np
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    from data.audio.features import W2vBertLayer
    from training.device import bf16_supported

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_only else "cpu")
    if device.type == "cuda" and not bf16_supported(device):
        raise Skip("this GPU has no native bf16")
    torch.manual_seed(0)
    config = Wav2Vec2BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                output_hidden_size=64, feature_projection_input_dim=160, conv_depthwise_kernel_size=5)
    rng = np.random.default_rng(0)
    fbanks = [rng.standard_normal((n, 160)).astype(np.float32) for n in (120, 300)]
    with tempfile.TemporaryDirectory(prefix="smoke") as folder:
        Wav2Vec2BertModel(config).eval().save_pretrained(folder)
        one_pass = lambda lengths: [np.arange(len(lengths))]  # noqa: E731 - both chunks in one forward pass
        feats = {dtype: W2vBertLayer(Path(folder), 2, device=device, dtype=dtype, max_chunk_seconds=30)(
                     fbanks, passes=one_pass) for dtype in (torch.float32, torch.bfloat16)}
    ref, low = (torch.from_numpy(np.concatenate(feats[d])).double() for d in (torch.float32, torch.bfloat16))
    cosine = float(torch.nn.functional.cosine_similarity(ref, low, dim=1).min())
    rel_mse = float((ref - low).square().mean() / ref.square().mean())
    return cosine >= W2V_MIN_COSINE, f"lowest per-frame cosine {cosine:.4f} (>= {W2V_MIN_COSINE}), " \
                                     f"relative MSE {rel_mse:.2e} on {device}", {"cosine": cosine, "rel_mse": rel_mse}


W2V_LAYER = 17
STEADY_SECONDS = 30  # steady-state work per run of the speed steps (benchmarks/bench_tokenize.py --work_seconds)
AGREE_MINUTES = 4  # audio extracted, encoded and tokenized whole for the codes' agreement
_audio_run: dict = {}  # what the extraction step leaves for the tokenize step


def audio_run_folder() -> Path:
    """A folder for the extraction steps: audio, a w2v-BERT 2.0-sized random model, their outputs."""
    if "folder" not in _audio_run:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="smoke_audio"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _audio_run["folder"] = folder
    return _audio_run["folder"]


def needs_extract_packages() -> None:
    import importlib.util

    missing = [m for m in ("soundfile", "soxr", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"needs requirements-extract.txt ({', '.join(missing)} missing): give gpu_smoke.sh its wheels")


def speed_figure(row: dict) -> str:
    """bench_tokenize's steady-state figures of one run in words."""
    mfu = f" (MFU {row['mfu']:.1%})" if "mfu" in row else f" ({row['gflop_per_s']:,.0f} GFLOP/s)"
    return f"{row['audio_s_per_s']:,.0f} audio seconds per second{mfu} over {row['steady_audio_s']:,.0f} s of " \
           f"audio after {row['startup_s']:.0f} s of start-up, padding {row['padding']:.0%}"


def step_extract_w2v_bert(args):
    """tools.extract (and tools.tokenize, reported by the next step) of a 2-20 s mix with a w2v-BERT 2.0-sized
    model (random weights: the speed does not depend on them), layer 17, bf16, in the steady state, and the model
    alone on the same passes (benchmarks/bench_tokenize.py): audio seconds per second, MFU, the pipeline's share
    of the model alone's speed."""
    needs_cuda()
    needs_extract_packages()
    from benchmarks.bench_tokenize import run_benchmark

    info = run_benchmark(device="cuda", model="w2v-bert-2.0", layer=W2V_LAYER, precision="bf16", mixes=("2-20s",),
                         modes=("extract", "model", "tokenize"), audio_minutes=2400, base_minutes=10,
                         work_seconds=STEADY_SECONDS, repeats=1, repos={"this tree": str(REPO)}, timeout=600,
                         say=lambda line: None)
    runs = info["runs"].get("this tree", {}).get("2-20s", {})
    _audio_run["bench"] = info
    row = runs.get("extract")
    if not row or "error" in row:
        return False, (row or {}).get("error", "no result")[-300:], info
    model = row.get("model")
    figure = f"extract: {speed_figure(row)}"
    if model:
        figure += f"; the model alone {model['audio_s_per_s']:,.0f} audio s/s, the pipeline at " \
                  f"{model['pipeline_share']:.0%} of it"
    return True, figure, info


def step_tokenize_w2v_bert(args):
    """tools.tokenize's steady-state speed as the extraction step measured it (a default-sized random codec
    recording those features), and the codes of a few minutes of audio tokenized whole against tools.extract +
    tools.encode of the same audio on the GPU."""
    needs_cuda()
    if "bench" not in _audio_run:
        raise Skip("needs the 'extract w2v-bert' step's run (run both)")
    import numpy as np

    from benchmarks.bench_tokenize import save_model, write_mix
    from data.feature_settings import dump_feature_settings
    from models.codec import CodecConfig, RVQCodec

    row = _audio_run["bench"]["runs"].get("this tree", {}).get("2-20s", {}).get("tokenize")
    if not row or "error" in row:
        return False, f"tokenize: {(row or {}).get('error', 'no result')[-300:]}", _audio_run["bench"]
    figures = {"tokenize": row}
    folder = audio_run_folder()
    corpus = write_mix(folder / "audio", "2-20s", AGREE_MINUTES, AGREE_MINUTES)
    save_model(folder / "w2v_bert", "w2v-bert-2.0")
    job = run([sys.executable, "-m", "tools.extract", corpus["manifest"], "train", 1, 0, folder / "feats",
               "--feature", "w2v-bert", "--checkpoint", folder / "w2v_bert", "--layer", W2V_LAYER, "--precision",
               "bf16", "--device", "cuda"], timeout=900)
    if job.returncode:
        return False, f"extract: exit {job.returncode}", {"stderr": job.stderr[-3000:]}
    torch.manual_seed(0)
    codec = RVQCodec(CodecConfig(feature_dim=1024, kmeans_init=False))
    torch.save({"model": codec.state_dict(), "codec": codec.config.to_dict(), "step": 0,
                "config": {"features": dump_feature_settings(folder / "feats", "train")}}, folder / "codec.pt")
    job = run([sys.executable, "-m", "tools.tokenize", corpus["manifest"], "train", 1, 0, folder / "tokens",
               "--checkpoint", folder / "codec.pt", "--device", "cuda"], timeout=900)
    if job.returncode:
        return False, f"tokenize: exit {job.returncode}", {"stderr": job.stderr[-3000:]}
    encoded = run([sys.executable, "-m", "tools.encode", "--checkpoint", folder / "codec.pt", "--data_dir",
                   folder / "feats", "--output_dir", folder / "codes", "--device", "cuda"], timeout=900)
    if encoded.returncode:
        return False, f"encode: exit {encoded.returncode}", {"stderr": encoded.stderr[-3000:]}
    tokens, codes = (np.load(folder / d / "train_0_1.codes.npy") for d in ("tokens", "codes"))
    agree = float((tokens == codes).mean()) if tokens.shape == codes.shape else 0.0
    figures["codes_agree_with_extract_encode"] = agree
    return agree >= 0.99, f"tokenize: {speed_figure(row)}; codes of {AGREE_MINUTES} min tokenized whole equal to " \
                          f"extract + encode's at {agree:.2%} of positions (>= 99%; on a GPU kernels chosen by " \
                          "shape may break near ties)", figures


# in order of what each proves per minute; True: the step can run on a CPU
STEPS = [
    ("versions", step_versions, True),
    ("doctor", step_doctor, True),
    ("host syncs", step_host_syncs, True),
    ("batch equality", step_batch_equality, True),
    ("w2v-bert bf16", step_w2v_bert_bf16, True),
    ("nccl one rank", step_nccl_one_rank, False),
    ("timeout drill", step_timeout_drill, False),
    ("fp32 losses", step_fp32_losses, False),
    ("compiled step", step_compiled_step, False),
    ("batch 512", step_batch_512, False),
    ("optimizer", step_optimizer, False),
    ("resume", step_resume, False),
    ("presets", step_presets, False),
    ("benchmarks", step_benchmarks, False),
    ("extract w2v-bert", step_extract_w2v_bert, False),
    ("tokenize w2v-bert", step_tokenize_w2v_bert, False),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-only", action="store_true", help="run the CPU-runnable steps; SKIP the CUDA ones")
    parser.add_argument("--only", nargs="*", choices=[name for name, _, _ in STEPS], help="run these steps only")
    parser.add_argument("--steps", type=int, default=120, help="training steps per preset run")
    parser.add_argument("--jobs", type=int, default=4, help="preset runs at a time on the GPU")
    parser.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/gpu_smoke_<device>.json)")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu_only or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    out = args.out or REPO / "benchmarks" / "results" / f"gpu_smoke_{re.sub(r'[^A-Za-z0-9]+', '_', device)}.json"
    results, failed = {}, 0
    if args.only and out.exists():  # a re-run of some steps updates them in the device's results
        earlier = json.loads(out.read_text())
        if earlier.get("device") == device:
            results = earlier["steps"]
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn, cpu_ok in STEPS:
        if args.only and name not in args.only:
            continue
        began = time.perf_counter()
        try:
            if args.cpu_only and not cpu_ok:
                raise Skip("needs CUDA (--cpu-only)")
            passed, figure, details = fn(args)
            status = "PASS" if passed else "FAIL"
        except Skip as why:
            status, figure, details = "SKIP", str(why), {}
        except Exception as e:  # noqa: BLE001 - a step that crashes is a failed step; the others still run
            status, figure, details = "FAIL", f"{type(e).__name__}: {e}", {}
        failed += status == "FAIL"
        seconds = time.perf_counter() - began
        print(f"{status} {name}: {figure} [{seconds:.0f} s]", flush=True)
        results[name] = {"status": status, "figure": figure, "seconds": round(seconds, 1), "details": details}
        results = {step: results[step] for step, _, _ in STEPS if step in results}
        # written after every step: a run cut short keeps what it measured
        out.write_text(json.dumps({"device": device, "torch": torch.__version__, "steps": results}, indent=1,
                                  default=str) + "\n")
    print(f"{'FAILED' if failed else 'OK'}: {failed} step(s) failed; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
