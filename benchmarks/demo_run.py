"""The Quick start's main job, timed: `bash run_nccl_optimized.sh conservative` on the demo corpus.

Prints the eval curve and the wall time as a markdown table and writes JSON.

    python benchmarks/demo_run.py [--out benchmarks/results/demo_run.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.metrics_log import run_events  # noqa: E402


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}"


def command_line() -> str:
    """This script's command as a shell line that runs it again: `python benchmarks/X.py ARGS`, an argument with a
    space, a quote or nothing in it quoted (a report's `command`)."""
    script = Path(sys.argv[0]).resolve()
    name = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(name), *sys.argv[1:]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo_run.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run = subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), "conservative"],
                             env={**os.environ, "OUTPUT_DIR": tmp}, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            return run.returncode
        events = run_events(tmp)
    evals = [e for e in events if e["event"] == "eval"]
    fps = [e["frames_per_sec"] for e in events if e["event"] == "train"]
    result = {"command": "bash run_nccl_optimized.sh conservative", "machine": machine(),
              "wall_seconds": round(seconds, 1), "median_frames_per_sec": sorted(fps)[len(fps) // 2],
              "evals": [{k: e[k] for k in ("step", "rel_mse", "cosine", "code_usage", "perplexity",
                                           "bits_per_frame")} for e in evals]}
    print(f"`{result['command']}` on {result['machine']}: {seconds / 60:.1f} min wall, "
          f"median {result['median_frames_per_sec']:,.0f} frames/s\n")
    print("| step | rel_mse | cosine | lowest code usage | lowest perplexity | bits/frame |")
    print("|---:|---:|---:|---:|---:|---:|")
    for e in evals:
        print(f"| {e['step']} | {e['rel_mse']:.4f} | {e['cosine']:.4f} | {min(e['code_usage']):.1%} | "
              f"{min(e['perplexity']):.0f} | {e['bits_per_frame']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
