"""Float16 against float32 fairseq dumps of the same features: crop reads and the device cache's gather.

A synthetic 160-d dump (the Seamless front-end's dim), written once as float32 and once as
float16, read in the trainer's default batches (64 crops of 128 frames) by data/crops.py's
CropReader (the prefetcher's and the plain path's reader) and gathered from a
data/device_cache.py cache holding each as stored. Files are in the page cache after writing.

    python benchmarks/bench_float16.py [--utterances 2000] [--seconds 3] [--out benchmarks/results/bench_float16.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from data.batch_plan import BatchPlan  # noqa: E402
from data.crops import CropReader  # noqa: E402
from data.device_cache import DeviceFeatureCache  # noqa: E402
from data.stores import open_stores  # noqa: E402

DIM, LENGTH, FRAMES_PER_STEP = 160, 128, 64 * 128  # the trainer's defaults


def frames_per_sec(get, seconds: float) -> float:
    for step in range(3):  # warm up
        get(step)
    step, start = 3, time.perf_counter()
    while time.perf_counter() - start < seconds:
        get(step)
        step += 1
    return (step - 3) * FRAMES_PER_STEP / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_float16.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 601, size=args.utterances)
    features = rng.standard_normal((int(lengths.sum()), DIM), dtype=np.float32)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "float16"):
            folder = Path(tmp) / dtype
            folder.mkdir()
            np.save(folder / "train_0_1.npy", features.astype(dtype))
            (folder / "train_0_1.len").write_text("".join(f"{n}\n" for n in lengths))
            store, _, _ = open_stores(folder, "train", "valid", seed=0)
            plan = BatchPlan(store.lengths, segment_lengths=[LENGTH], frames_per_step=FRAMES_PER_STEP, seed=0)
            reader, out = CropReader(store), np.empty((FRAMES_PER_STEP // LENGTH, LENGTH, DIM), np.float32)

            def read(step):
                batch = plan.batch(step)
                reader.read(batch.utterances, batch.starts, LENGTH, out=out)

            cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e12, show_progress=False,
                                       dtype=torch.float16 if dtype == "float16" else torch.float32)
            results[dtype] = {"dump_bytes": int((folder / "train_0_1.npy").stat().st_size),
                              "crop_reads_frames_per_sec": round(frames_per_sec(read, args.seconds)),
                              "cache_gather_frames_per_sec": round(frames_per_sec(cache.get, args.seconds))}
            cache.close()
    report = {"machine": machine(), "utterances": args.utterances, "frames": int(lengths.sum()), **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| dump | size | crop reads, frames/s | cache gather, frames/s |\n|---|---:|---:|---:|")
    for dtype, r in results.items():
        print(f"| {dtype} | {r['dump_bytes'] / 1e9:.2f} GB | {r['crop_reads_frames_per_sec'] / 1e6:.1f}M | "
              f"{r['cache_gather_frames_per_sec'] / 1e6:.1f}M |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
