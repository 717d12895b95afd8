"""The trainer's CPU threads on a shared machine: its own choice against one thread, alone and beside a busy neighbour.

Each row is the trainer as a subprocess (benchmarks/bench_step.py's `run`: the demo corpus, `--compile on` by
default, frames/s over every `--log_every` window but the first), in three settings:

- its own choice (no --threads, no OMP_NUM_THREADS: training/threads.py decides, and the row records what and why);
- `--threads N` with N = torch's default here (the cores): what the trainer ran with before it chose;
- OMP_NUM_THREADS=1: the same trainer pinned to one thread, the reference of each condition;

each alone, then each beside a neighbour: another process running a 2-thread torch matrix-product loop, started
before the trainer and stopped after it (as another user's job would be). Rows are interleaved, condition by
condition, `--repeats` times, and the best of each is kept.

    python benchmarks/bench_threads.py [--steps 200] [--log_every 40] [--repeats 1]
    # each run bounded in time (a row with no window after the first in time reads 0 frames/s):
    python benchmarks/bench_threads.py --steps 300 --log_every 10 --flags "--compile on --max_minutes 3"
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_step import run  # noqa: E402
from benchmarks.demo_run import machine  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402

NEIGHBOUR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(512, 512)
print("ready", flush=True)
while True:
    a @ a
"""


@contextlib.contextmanager
def neighbour(threads: int | None):
    """A busy torch process with `threads` threads, running once it says so; None: no neighbour."""
    if not threads:
        yield
        return
    job = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(threads)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    try:
        if job.stdout.readline().strip() != "ready":
            raise RuntimeError("the neighbour process did not start")
        yield
    finally:
        job.kill()
        job.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--log_every", type=int, default=40, help="steps per window (the first window is left out)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every row; the best is kept")
    parser.add_argument("--neighbour_threads", type=int, default=2, help="the busy neighbour's torch threads")
    parser.add_argument("--flags", default="--compile on", help="the trainer's flags in every row")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_threads.json"))
    args = parser.parse_args()
    data_dir = ensure_demo_corpus()
    cores = torch.get_num_threads()  # torch's default here, unless this shell set OMP_NUM_THREADS
    if os.environ.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows = {"its own choice": (base, []),
            f"--threads {cores} (before: torch's default)": (base, ["--threads", str(cores)]),
            "OMP_NUM_THREADS=1": ({**base, "OMP_NUM_THREADS": "1"}, [])}
    conditions = {"alone": None, f"beside a {args.neighbour_threads}-thread torch job": args.neighbour_threads}
    best: dict[str, dict[str, dict]] = {c: {} for c in conditions}
    for repeat in range(args.repeats):
        for condition, threads in conditions.items():
            with neighbour(threads):
                for name, (env, flags) in rows.items():
                    print(f"repeat {repeat + 1}/{args.repeats}, {condition}: {name}", file=sys.stderr)
                    result = run(REPO, [*args.flags.split(), *flags], args.steps, args.log_every, data_dir, env=env)
                    result["load_average_1min"] = round(os.getloadavg()[0], 2)
                    kept = best[condition].get(name)
                    if kept is None or result["frames_per_sec"] > kept["frames_per_sec"]:
                        best[condition][name] = result
    own, previous = list(rows)[:2]
    print(f"Trainer ({args.flags}, {args.steps} steps) on {machine()}:\n")
    print("| condition | trainer | threads | frames/s | vs OMP_NUM_THREADS=1 | why (its own choice) |")
    print("|---|---|---:|---:|---:|---|")
    for condition, results in best.items():
        one = results["OMP_NUM_THREADS=1"]["frames_per_sec"] or float("nan")
        for name, row in results.items():
            row["vs_one_thread"] = round(row["frames_per_sec"] / one, 2)
            why = row.get("threads_why", "") if name == own else ""
            print(f"| {condition} | {name} | {row.get('threads', '')} | {row['frames_per_sec']:,} | "
                  f"{row['vs_one_thread']:.2f}x | {why} |")
    alone = best["alone"]
    own_vs_before = round(alone[own]["frames_per_sec"] / (alone[previous]["frames_per_sec"] or float("nan")), 2)
    print(f"\nalone, its own choice against --threads {cores}: {own_vs_before:.2f}x")
    out = Path(args.out)
    out.write_text(json.dumps({"command": "python benchmarks/bench_threads.py " + " ".join(sys.argv[1:]),
                               "machine": machine(), "flags": args.flags, "steps": args.steps,
                               "log_every": args.log_every, "repeats": args.repeats, "cores": cores,
                               "alone_own_choice_vs_before": own_vs_before, "rows": best}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
