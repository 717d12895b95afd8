"""The trainer itself (train_step with its snapshot, guard, phases and progress bar), eager against compiled,
and against the trainer of an earlier commit, on the demo corpus.

Each run is the trainer as a subprocess (`--max_steps`, no eval, checkpoint or refit inside the timed steps);
frames/s is over every `--log_every` window but the first (the k-means init and the compile of the first step),
total frames / total time; the compile time comes from the trainer's log. Runs are interleaved `--repeats`
times and the best of each row is kept. `--baseline REV` adds the trainer at git revision REV (checked out into
a temporary worktree, run with its own defaults: before `--compile` existed, the eager step).

    # the host-bound proxy: a codec so small that a CPU step is mostly host work, as a GPU step is
    python benchmarks/bench_step.py --codec tiny --steps 2000 --log_every 200 --baseline d487d4c \
        --row "--compile on --dead_code_every 10"
    # the default codec at the CPU's default batch
    python benchmarks/bench_step.py --codec default --steps 300 --log_every 30 --baseline d487d4c
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_train import compile_seconds  # noqa: E402
from benchmarks.demo_run import machine  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402
from training.metrics_log import run_events  # noqa: E402

CODECS = {
    "tiny": ["--latent_dim", "16", "--codebook_size", "64", "--encoder_blocks", "1", "--batch_size", "4",
             "--segment_length", "16"],
    "default": [],
}


# the trainer's log line with its thread count and why (rvq_seamless_gpu_cache_nccl.set_threads)
THREADS_LOG = re.compile(r"threads: (\d+) \((.*)\)\s*$", re.MULTILINE)


def run(repo: Path, flags: list[str], steps: int, log_every: int, data_dir: Path, env: dict | None = None) -> dict:
    """env: the trainer's environment (default: this process's)."""
    with tempfile.TemporaryDirectory(prefix="bench_step") as out:
        cmd = [sys.executable, str(repo / "rvq_seamless_gpu_cache_nccl.py"), "--data_dir", str(data_dir),
               "--output_dir", out, "--resume", "none", "--max_steps", str(steps), "--log_every", str(log_every),
               "--eval_every", str(10 * steps), "--save_every", str(10 * steps), "--refit_iters", "0", *flags]
        job = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, env=env)
        if job.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{job.stderr[-3000:]}")
        events = run_events(out)
    windows = [e["frames_per_sec"] for e in events if e["event"] == "train"][1:]
    threads = THREADS_LOG.search(job.stderr)  # absent from a trainer before training/threads.py
    # no window after the first: a run cut short by --max_minutes before it got there (frames/s 0)
    return {"frames_per_sec": round(len(windows) / sum(1 / f for f in windows)) if windows else 0,
            "windows": len(windows),
            "compile_seconds": compile_seconds(job.stderr),
            **({"threads": int(threads[1]), "threads_why": threads[2]} if threads else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", choices=sorted(CODECS), default="tiny")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--log_every", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", default="off,on", help="the --compile values to run, comma-separated")
    parser.add_argument("--baseline", default=None, help="also the trainer at this git revision (eager)")
    parser.add_argument("--row", action="append", default=[],
                        help='an extra row of this trainer with these flags, e.g. "--compile on --dead_code_every 10"')
    parser.add_argument("--out", default=None, help="JSON (default benchmarks/results/bench_step_<codec>.json)")
    args = parser.parse_args()
    data_dir = ensure_demo_corpus()
    rows = {f"--compile {value}": (REPO, ["--compile", value]) for value in args.compile.split(",") if value}
    rows.update({flags: (REPO, flags.split()) for flags in args.row})
    with tempfile.TemporaryDirectory(prefix="bench_step_baseline") as folder:
        if args.baseline:
            worktree = Path(folder) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline], cwd=REPO, check=True,
                           capture_output=True)
            rows = {f"{args.baseline} (before --compile)": (worktree, []), **rows}
        try:
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for name, (repo, flags) in rows.items():
                    result = run(repo, [*CODECS[args.codec], *flags], args.steps, args.log_every, data_dir)
                    if name not in best or result["frames_per_sec"] > best[name]["frames_per_sec"]:
                        best[name] = result
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
    reference = best[next(iter(best))]["frames_per_sec"]
    print(f"| trainer ({args.codec} codec, {args.steps} steps) | frames/s | vs {next(iter(best))} | compile |")
    print("|---|---:|---:|---:|")
    for name, row in best.items():
        row["vs_first"] = round(row["frames_per_sec"] / reference, 2)
        compiled = f"{row['compile_seconds']:.1f} s" if row["compile_seconds"] is not None else ""
        print(f"| {name} | {row['frames_per_sec']:,} | {row['vs_first']:.2f}x | {compiled} |")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"bench_step_{args.codec}.json")
    out.write_text(json.dumps({"machine": machine(), "codec": args.codec, "flags": CODECS[args.codec],
                               "steps": args.steps, "log_every": args.log_every, "repeats": args.repeats,
                               "rows": best}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
