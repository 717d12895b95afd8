"""Start-up, whole-run time and memory against the number of utterances in the store.

Fairseq dumps of 10^4, 10^5 and 10^6 short utterances (40 frames of 16-d each, a 2.6 GB
.npy at 10^6), made cheaply: the .npy is a sparse file (its frames are zeros, never
written), so only the .len file and the header cost anything. The trainer runs on each, one
process on the CPU, 10 steps of a tiny codec with the codebook refit and the final eval, no
validation split (2% held out by the seed), and this script measures:

- time to the first `train` event, from the process's start;
- the whole run's wall time;
- peak resident memory (the process's maxrss);
- what the process had read when the first `train` event appeared: bytes through read()
  (`rchar` in /proc/PID/io) and file-backed resident memory (`RssFile`: memory-mapped
  pages of the dump it touched, plus the shared libraries, the same at every size).

    python benchmarks/bench_scale.py [--sizes 10000,100000,1000000] [--out benchmarks/results/bench_scale.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from training.run_folder import RunFolder  # noqa: E402

FRAMES, DIM = 40, 16
TRAINER_FLAGS = ["--latent_dim", "32", "--num_quantizers", "2", "--codebook_size", "32", "--batch_size", "4",
                 "--segment_length", "32", "--max_steps", "10", "--log_every", "1", "--eval_every", "1000",
                 "--resume", "none"]


def write_sparse_dump(folder: Path, utterances: int) -> None:
    """`train_0_1.npy` of zeros [utterances * FRAMES, DIM] as a sparse file, and its .len."""
    folder.mkdir(parents=True)
    rows = utterances * FRAMES
    with open(folder / "train_0_1.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, DIM)})
        f.truncate(f.tell() + rows * DIM * 4)
    (folder / "train_0_1.len").write_text(f"{FRAMES}\n" * utterances)


def proc_field(path: str, name: str) -> int:
    for line in open(path):
        if line.startswith(name):
            return int(line.split()[1])
    return 0


def run(data_dir: Path, out_dir: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(REPO / "rvq_seamless_gpu_cache_nccl.py"), "--data_dir",
                             str(data_dir), "--output_dir", str(out_dir), *TRAINER_FLAGS], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    metrics, first = RunFolder(out_dir).metrics, None
    while proc.poll() is None and first is None:
        if metrics.exists() and '"event": "train"' in metrics.read_text():
            first = {"seconds_to_first_train_event": round(time.perf_counter() - start, 2),
                     "read_bytes_before_first_step": proc_field(f"/proc/{proc.pid}/io", "rchar:"),
                     "file_backed_rss_mb_at_first_step": round(proc_field(f"/proc/{proc.pid}/status", "RssFile:")
                                                               / 1024, 1)}
        time.sleep(0.02)
    # the child's peak RSS, read before it is reaped
    peak_kb = proc_field(f"/proc/{proc.pid}/status", "VmHWM:") if proc.poll() is None else 0
    while proc.poll() is None:
        peak_kb = max(peak_kb, proc_field(f"/proc/{proc.pid}/status", "VmHWM:"))
        time.sleep(0.02)
    stderr = proc.stderr.read()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"the trainer failed on {data_dir}:\n{stderr[-3000:]}")
    return {**first, "whole_run_seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": round(peak_kb / 1024)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_scale.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            write_sparse_dump(Path(tmp) / f"data{n}", n)
            results[n] = run(Path(tmp) / f"data{n}", Path(tmp) / f"run{n}")
            print(n, results[n], flush=True)
    base = results[sizes[0]]
    report = {"machine": machine(), "flags": TRAINER_FLAGS, "frames_per_utterance": FRAMES, "dim": DIM,
              "results": {str(n): r for n, r in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| utterances | first train event | whole run (10 steps, refit, final eval) | peak RSS | read() before "
          "step 1 | file-backed RSS at step 1 |\n|---:|---:|---:|---:|---:|---:|")
    for n, r in results.items():
        ratio = lambda key: r[key] / base[key]  # noqa: E731
        print(f"| {n:,} | {r['seconds_to_first_train_event']:.1f} s ({ratio('seconds_to_first_train_event'):.2f}x) "
              f"| {r['whole_run_seconds']:.1f} s ({ratio('whole_run_seconds'):.2f}x) "
              f"| {r['peak_rss_mb']} MB ({ratio('peak_rss_mb'):.2f}x) "
              f"| {r['read_bytes_before_first_step'] / 1e6:.1f} MB | {r['file_backed_rss_mb_at_first_step']} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
