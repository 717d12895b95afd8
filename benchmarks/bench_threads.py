"""The trainer's CPU threads on a shared machine: its own choice against one thread, alone and beside a busy neighbour
(`--encode CHECKPOINT`: tools.encode's, which chooses them the same way).

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
    # tools.encode of a split (frames/s from its own log line), with torch's default as the "before" row:
    python benchmarks/bench_threads.py --encode RUN_DIR --data_dir .cache/speech_corpus --split valid
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_step import run  # noqa: E402
from benchmarks.demo_run import command_line, machine  # noqa: E402
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


ENCODED = re.compile(r"encoded (\d+) feature frames in ([\d.]+) s: (\d+) frames/s")
THREADS = re.compile(r"threads: (\d+) \((.*)\)")


def run_encode(checkpoint: str, data_dir: str, split: str, env: dict) -> dict:
    """tools.encode of `split` into a fresh folder: its frames/s and threads, as its log says them."""
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, "-m", "tools.encode", "--checkpoint", checkpoint, "--data_dir", data_dir,
                            "--split", split, "--output_dir", out], cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    frames, seconds, rate = ENCODED.search(r.stderr).groups()
    chosen = THREADS.search(r.stderr)
    return {"frames": int(frames), "seconds": float(seconds), "frames_per_sec": int(rate),
            "threads": int(chosen[1]) if chosen else None, "threads_why": chosen[2] if chosen else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--log_every", type=int, default=40, help="steps per window (the first window is left out)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every row; the best is kept")
    parser.add_argument("--neighbour_threads", type=int, default=2, help="the busy neighbour's torch threads")
    parser.add_argument("--flags", default="--compile on", help="the trainer's flags in every row")
    parser.add_argument("--encode", metavar="CHECKPOINT", help="time tools.encode with this codec instead of training")
    parser.add_argument("--data_dir", help="--encode: the features (default: the demo corpus)")
    parser.add_argument("--split", default="valid", help="--encode: the split encoded")
    parser.add_argument("--out", default=None, help="default: results/bench_threads.json (--encode: "
                                                    "bench_threads_encode.json)")
    args = parser.parse_args()
    data_dir = args.data_dir or ensure_demo_corpus()
    results_dir = REPO / "benchmarks" / "results"
    args.out = args.out or str(results_dir / ("bench_threads_encode.json" if args.encode else "bench_threads.json"))
    cores = torch.get_num_threads()  # torch's default here, unless this shell set OMP_NUM_THREADS
    if os.environ.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows = {"its own choice": (base, []),
            f"--threads {cores} (before: torch's default)": (base, ["--threads", str(cores)]),
            "OMP_NUM_THREADS=1": ({**base, "OMP_NUM_THREADS": "1"}, [])}
    if args.encode:  # the command has no --threads: torch's default, as it computed before it chose, by the variable
        rows = {"its own choice": (base, []),
                f"OMP_NUM_THREADS={cores} (before: torch's default)": ({**base, "OMP_NUM_THREADS": str(cores)}, []),
                "OMP_NUM_THREADS=1": ({**base, "OMP_NUM_THREADS": "1"}, [])}
    conditions = {"alone": None, f"beside a {args.neighbour_threads}-thread torch job": args.neighbour_threads}
    best: dict[str, dict[str, dict]] = {c: {} for c in conditions}
    for repeat in range(args.repeats):
        for condition, threads in conditions.items():
            with neighbour(threads):
                for name, (env, flags) in rows.items():
                    print(f"repeat {repeat + 1}/{args.repeats}, {condition}: {name}", file=sys.stderr)
                    result = (run_encode(args.encode, data_dir, args.split, env) if args.encode else
                              run(REPO, [*args.flags.split(), *flags], args.steps, args.log_every, data_dir, env=env))
                    result["load_average_1min"] = round(os.getloadavg()[0], 2)
                    kept = best[condition].get(name)
                    if kept is None or result["frames_per_sec"] > kept["frames_per_sec"]:
                        best[condition][name] = result
    own, previous = list(rows)[:2]
    what = (f"tools.encode --checkpoint {args.encode} --split {args.split}" if args.encode else
            f"Trainer ({args.flags}, {args.steps} steps)")
    print(f"{what} on {machine()}:\n")
    print("| condition | run | threads | frames/s | vs OMP_NUM_THREADS=1 | why (its own choice) |")
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
    print(f"\nalone, its own choice against {previous}: {own_vs_before:.2f}x")
    out = Path(args.out)
    out.write_text(json.dumps({"command": command_line(),
                               "machine": machine(), "measured": what, "flags": args.flags, "steps": args.steps,
                               "log_every": args.log_every, "repeats": args.repeats, "cores": cores,
                               "alone_own_choice_vs_before": own_vs_before, "rows": best}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
