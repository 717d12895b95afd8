"""Whole training steps: our trainer against the plain loop a user would write, same configuration.

Our trainer runs as a subprocess (as users run it) with `--use_gpu_cache`, then with
`--prefetch`; frames/s and data_wait_frac are read from its metrics.jsonl. The plain
loop runs in this process: a DataLoader over per-utterance `.npy` files with random
crops (bench_data.NpyCropDataset), the same codec (models.codec.RVQCodec, with
vector-quantize-pytorch), AdamW and gradient clipping, timed with the trainer's
definitions: frames/s over a window of `--log_every` steps, data_wait_frac the share
of the window spent getting the batch. The first window is left out (the plain loop's
k-means init; our trainer runs its k-means on as many frames as one batch, and any
compile, before its first step); the figure is over all the other windows (total
frames / total time), and the best of `--repeats` interleaved runs of each loop is
kept (the same rule for every loop).

`--compile` is passed to our trainer (default off: the eager step, whatever the trainer's
own default); a list, `--compile off,on`, runs each of our configurations once per value,
each row named with its value, and gives each compiled row its compile time (from the
trainer's log line "compile: ... in X s") and its frames/s against the same row eager
(`vs_eager`). The plain loop stays eager.

    python benchmarks/bench_train.py [--steps 60] [--out benchmarks/results/bench_train.json]
    # the host-bound proxy (a tiny codec) and the default codec on a CPU, eager against compiled:
    python benchmarks/bench_train.py --codec tiny --steps 2000 --log_every 200 --compile off,on
    python benchmarks/bench_train.py --codec default --steps 300 --log_every 30 --compile off,on --ours gpu_cache
    # on a GPU (benchmarks/gpu_smoke.py, "benchmarks"): the default codec and batch, eager and compiled
    python benchmarks/bench_train.py --device cuda --codec default --compile off,on --ours gpu_cache --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_data import DIM, forever, plain_loader, write_synthetic  # noqa: E402
from benchmarks.demo_run import command_line, machine  # noqa: E402
from data.training_data import AUTO_LENGTHS, DEFAULT_BATCH  # noqa: E402
from models.codec import CodecConfig, RVQCodec  # noqa: E402
from training.device import compute_dtype  # noqa: E402
from training.metrics_log import run_events  # noqa: E402

# --codec small: a smaller codec and batch than the defaults, for CPU figures; --codec default: the trainer's
# codec and its default batch on the device (data.training_data.DEFAULT_BATCH) at the automatic length;
# --codec tiny: so little arithmetic that a CPU step is mostly host overhead (Python, dispatch), as a GPU step
# of the default codec is: a CUDA-free proxy for what the loop adds per step (run it with more steps)
CODEC_DEFAULTS = CodecConfig(feature_dim=DIM)
CONFIGS = {
    "small": {"latent_dim": 128, "num_quantizers": 4, "codebook_size": 256, "batch_size": 32, "segment_length": 128},
    "default": {"latent_dim": CODEC_DEFAULTS.latent_dim, "num_quantizers": CODEC_DEFAULTS.num_quantizers,
                "codebook_size": CODEC_DEFAULTS.codebook_size, "segment_length": AUTO_LENGTHS[0]},
    "tiny": {"latent_dim": 16, "num_quantizers": CODEC_DEFAULTS.num_quantizers, "codebook_size": 32, "batch_size": 4,
             "segment_length": 16},
}
CONFIG = dict(CONFIGS["small"])  # main() sets it from --codec and --device
COMPILE_VALUES = ("off", "on", "cudagraphs", "auto")  # the trainer's --compile choices (models/compiled_step.py)
OURS = ("basic", "gpu_cache", "prefetch", "cache_prefetch")  # --ours: our trainer's configurations (main() names them)
# the trainer's log line when it compiled the step before the first one (rvq_seamless_gpu_cache_nccl.compile_step)
COMPILED_LOG = re.compile(r"compile: the training step for segment length \d+ compiled .* in ([0-9.]+) s\s*$",
                          re.MULTILINE)


def compile_seconds(log: str) -> float | None:
    """The trainer's compile time (the first step of each segment length), from its log; None: it ran eager."""
    times = [float(t) for t in COMPILED_LOG.findall(log)]
    return round(sum(times), 1) if times else None


def summarise(windows: list[tuple[float, float]]) -> dict:
    """windows: (frames/s, data_wait_frac) of equal-frame windows, the first already dropped."""
    fps = len(windows) / sum(1 / f for f, _ in windows)  # equal frames per window: the harmonic mean
    return {"frames_per_sec": round(fps), "data_wait_frac": round(float(np.mean([w for _, w in windows])), 4),
            "windows": len(windows)}


def run_ours(data_dir: Path, steps: int, log_every: int, flags: list[str], device: str,
             compile_flag: str = "off") -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_train") as out:
        cmd = [sys.executable, str(REPO / "rvq_seamless_gpu_cache_nccl.py"), "--data_dir", str(data_dir),
               "--output_dir", out, "--resume", "none", "--max_steps", str(steps), "--log_every", str(log_every),
               "--eval_every", str(10 * steps), "--save_every", str(10 * steps), "--device", device,
               # k-means on as many frames as one batch, as the plain loop's codec does on its first batch, but
               # before the first step, so that the first step compiles (timed in the log; the first window is left out)
               "--kmeans_init_frames", str(CONFIG["batch_size"] * CONFIG["segment_length"]),
               *[f"--{k}={v}" for k, v in CONFIG.items()], "--compile", compile_flag, *flags]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
        events = run_events(out)
    train = [e for e in events if e["event"] == "train"][1:]
    return {**summarise([(e["frames_per_sec"], e["data_wait_frac"]) for e in train]),
            "mfu": round(float(np.mean([e["mfu"] for e in train])), 4), "compile": compile_flag,
            "compile_seconds": compile_seconds(run.stderr)}  # None: eager (off, or auto deciding so)


def run_plain(data_dir: Path, lengths, steps: int, log_every: int, num_workers: int, device: str,
              dim: int = DIM) -> dict:
    torch.manual_seed(0)
    np.random.seed(0)
    loader = plain_loader(data_dir, lengths, CONFIG["segment_length"], CONFIG["batch_size"], num_workers)
    batches = forever(loader)
    model = RVQCodec(CodecConfig(feature_dim=dim, latent_dim=CONFIG["latent_dim"],
                                 num_quantizers=CONFIG["num_quantizers"], codebook_size=CONFIG["codebook_size"])).to(device)
    sample = torch.cat([next(batches).reshape(-1, dim) for _ in range(4)])
    model.set_feature_stats(sample.mean(0).to(device), sample.std(0).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.99))
    amp = compute_dtype("auto", torch.device(device))  # the trainer's default precision: bf16 where native
    windows, wait, frames, start = [], 0.0, 0, time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        x = next(batches).to(device, non_blocking=True)
        wait += time.perf_counter() - t
        with torch.autocast(torch.device(device).type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(x)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        frames += x.shape[0] * x.shape[1]
        if (step + 1) % log_every == 0:
            out.loss.item()  # the window's honest end: the device has finished its steps
            seconds = time.perf_counter() - start
            windows.append((frames / seconds, wait / seconds))
            wait, frames, start = 0.0, 0, time.perf_counter()
    del batches, loader
    return summarise(windows[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utterances", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each loop; the best is kept")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_train.json"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda: both loops train there")
    parser.add_argument("--dim", type=int, default=DIM,
                        help=f"feature dim of the synthetic store ({DIM}: Seamless fbank; 1024: w2v-BERT layers)")
    parser.add_argument("--codec", choices=sorted(CONFIGS), default="small",
                        help="small (the CPU figures), default (the trainer's codec and default batch) or tiny (host overhead)")
    parser.add_argument("--batch_size", type=int, help="crops per step (default: the --codec config's, or the "
                                                        "trainer's default on the device)")
    parser.add_argument("--compile", default="off",
                        help=f"our trainer's --compile, one of {', '.join(COMPILE_VALUES)}, or several "
                             "comma-separated (off,on): each of our configurations runs once per value")
    parser.add_argument("--ours", default=",".join(OURS),
                        help=f"which of our configurations run, comma-separated from {', '.join(OURS)} "
                             "(all by default)")
    args = parser.parse_args()
    compiles = list(dict.fromkeys(v.strip() for v in args.compile.split(",") if v.strip()))
    bad = [v for v in compiles if v not in COMPILE_VALUES]
    if bad or not compiles:
        parser.error(f"--compile {args.compile}: each value must be one of {', '.join(COMPILE_VALUES)}")
    if "cudagraphs" in compiles and torch.device(args.device).type != "cuda":
        parser.error("--compile cudagraphs needs --device cuda (CUDA graphs); use off, on or auto")
    ours = list(dict.fromkeys(v.strip() for v in args.ours.split(",") if v.strip()))
    if not ours or any(v not in OURS for v in ours):
        parser.error(f"--ours {args.ours}: each value must be one of {', '.join(OURS)}")
    CONFIG.clear()
    CONFIG.update(CONFIGS[args.codec])
    CONFIG["batch_size"] = args.batch_size or CONFIG.get("batch_size") or DEFAULT_BATCH[torch.device(args.device).type]
    load_at_start = round(os.getloadavg()[0], 2)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_train_data") as tmp:
        lengths = write_synthetic(Path(tmp), args.utterances, dim=args.dim)
        gb = lengths.sum() * args.dim * 4 / 1e9  # the cache keeps fp32 on a CPU
        budget = round(gb / 4, 3)
        configs = {
            "basic": ("ours: batches on the main thread (preset basic)", []),
            "gpu_cache": (f"ours: --use_gpu_cache (all {gb:.2f} GB cached)", ["--use_gpu_cache"]),
            "prefetch": ("ours: --prefetch (no cache)", ["--prefetch", "--prefetch_depth", "4"]),
            "cache_prefetch": (f"ours: --use_gpu_cache --prefetch --gpu_cache_gb {budget} (1/4 of {gb:.2f} GB cached, "
                               "rest prefetched)", ["--use_gpu_cache", "--prefetch", "--prefetch_depth", "4",
                                                    "--gpu_cache_gb", str(budget)]),
        }
        # each of our configurations once per --compile value, the row named with it; eager_of: a row's eager twin
        runs, eager_of = [], {}
        for key in ours:
            name, option = configs[key]
            for value in compiles:
                runs.append((f"{name} --compile {value}", "ours", (option, value)))
                eager_of[runs[-1][0]] = f"{name} --compile off"
        runs += [("plain loop: DataLoader num_workers=0", "plain", 0),
                 ("plain loop: DataLoader num_workers=2", "plain", 2)]
        # interleaved repeats, the best kept for every loop alike: other work on the machine only slows runs down
        for repeat in range(args.repeats):
            for name, kind, option in runs:
                print(f"repeat {repeat + 1}/{args.repeats}: {name}", file=sys.stderr)
                row = (run_ours(Path(tmp), args.steps, args.log_every, option[0], args.device, option[1])
                       if kind == "ours" else run_plain(Path(tmp), lengths, args.steps, args.log_every, option,
                                                        args.device, args.dim))
                if name not in rows or row["frames_per_sec"] > rows[name]["frames_per_sec"]:
                    rows[name] = row
    best_plain = max(v["frames_per_sec"] for k, v in rows.items() if k.startswith("plain"))
    for name, row in rows.items():
        row["vs_best_plain"] = round(row["frames_per_sec"] / best_plain, 2)
        # what the loop would reach if getting its batches took no time: the ceiling a data path can lift it to
        row["frames_per_sec_no_wait"] = round(row["frames_per_sec"] / (1 - row["data_wait_frac"]))
        eager = rows.get(eager_of.get(name))
        if eager is not None and eager is not row:  # a compiled row against the same configuration eager
            row["vs_eager"] = round(row["frames_per_sec"] / eager["frames_per_sec"], 2)
    result = {"command": command_line(), "machine": machine(),
              "load_average_1min_at_start": load_at_start,
              "codec": args.codec, "dim": args.dim, "config": CONFIG, "steps": args.steps, "repeats": args.repeats,
              "log_every": args.log_every, "utterances": args.utterances, "compile": compiles, "runs": rows}
    print(f"Training steps on {result['machine']}: {args.dim}-d features, codec latent {CONFIG['latent_dim']}, "
          f"{CONFIG['num_quantizers']} x {CONFIG['codebook_size']} codes, {CONFIG['batch_size']} crops of "
          f"{CONFIG['segment_length']} frames per step, {args.steps} steps (first {args.log_every} left out).\n")
    print("| loop | frames/s | data_wait_frac | vs best plain loop | frames/s with no data wait | compile time | "
          "vs --compile off |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        compile_s = f"{row['compile_seconds']:.1f} s" if row.get("compile_seconds") is not None else ""
        vs_eager = f"{row['vs_eager']:.2f}x" if "vs_eager" in row else ""
        print(f"| {name} | {row['frames_per_sec']:,} | {row['data_wait_frac']:.1%} | {row['vs_best_plain']:.2f}x | "
              f"{row['frames_per_sec_no_wait']:,} | {compile_s} | {vs_eager} |")
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)  # other work on the machine skews figures
    print(f"\n1-minute load average: {result['load_average_1min_at_start']} at start, "
          f"{result['load_average_1min_at_end']} at end")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
