"""Batch assembly speed: our device cache and prefetcher against the DataLoader most users write.

Synthetic 160-d stores (the Seamless front-end's dim) at 1x, 4x and 16x a base size,
written twice in a temp dir: one `.npy` file per utterance (for the DataLoader) and a
fairseq dump (for the prefetcher and the cache). Measured, with no model step in the way:

- `DataLoader`: a Dataset whose __getitem__ np.loads an utterance file and takes a random
  crop, default collate, shuffled, at `num_workers` 0 and 2 (what users write).
- `prefetcher`: data/prefetcher.py over the memory-mapped fairseq dump (depth 4, 1 worker).
- `cache`: data/device_cache.py (on this machine's device: RAM on a CPU-only machine), fp32 (the
  trainer's choice on a CPU) and fp16 (its choice on a GPU without bf16).

Then the cache's frames/s at each segment length of the multi-length plan (one token
budget, so batch size x length is constant). Files are in the page cache after writing,
so the DataLoader's figure is its best case, not a cold disk.

    python benchmarks/bench_data.py [--base_utterances 1500] [--seconds 3] [--out benchmarks/results/bench_data.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from data.batch_plan import BatchPlan  # noqa: E402
from data.device_cache import DeviceFeatureCache  # noqa: E402
from data.prefetcher import Prefetcher  # noqa: E402
from data.stores import open_stores  # noqa: E402

DIM = 160
SEGMENT_LENGTHS = (64, 128, 256, 512)
BASE_LENGTH, FRAMES_PER_STEP = 128, 64 * 128  # the trainer's defaults: --segment_length 128, --batch_size 64


def write_synthetic(folder: Path, utterances: int, seed: int = 0, dim: int = DIM) -> np.ndarray:
    """Both layouts of the same utterances (64-600 frames, 1.3-12 s at 50 Hz) of `dim` features; returns the
    lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 601, size=utterances)
    (folder / "files").mkdir(parents=True)
    with open(folder / "train_0_1.npy", "wb") as dump:
        np.lib.format.write_array_header_1_0(dump, {"descr": "<f4", "fortran_order": False,
                                                    "shape": (int(lengths.sum()), dim)})
        for i, n in enumerate(lengths):
            utt = rng.standard_normal((int(n), dim), dtype=np.float32)
            dump.write(utt.tobytes())
            np.save(folder / "files" / f"utt{i:06d}.npy", utt)
    (folder / "train_0_1.len").write_text("".join(f"{n}\n" for n in lengths))
    np.save(folder / "valid_0_1.npy", rng.standard_normal((BASE_LENGTH, dim), dtype=np.float32))
    (folder / "valid_0_1.len").write_text(f"{BASE_LENGTH}\n")
    return lengths


class NpyCropDataset(torch.utils.data.Dataset):
    """The loader users write: one file per utterance, loaded and randomly cropped in __getitem__."""

    def __init__(self, files, lengths, segment_length: int):
        self.segment_length = segment_length
        self.files = [f for f, n in zip(files, lengths) if n >= segment_length]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        features = np.load(self.files[i])
        start = np.random.randint(0, len(features) - self.segment_length + 1)
        return torch.from_numpy(features[start : start + self.segment_length])


def plain_loader(folder: Path, lengths, segment_length: int, batch_size: int, num_workers: int):
    files = sorted((folder / "files").glob("*.npy"))
    return torch.utils.data.DataLoader(NpyCropDataset(files, lengths, segment_length), batch_size=batch_size,
                                       shuffle=True, num_workers=num_workers, drop_last=True,
                                       persistent_workers=num_workers > 0)


def forever(loader):
    """Batches across epochs, as a training loop over epochs sees them."""
    while True:
        yield from loader


def rate(next_batch, seconds: float, warmup: int = 3) -> dict:
    """Batches and frames per second of calling `next_batch()` for about `seconds`."""
    for _ in range(warmup):
        next_batch()
    count, frames, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += _frames(next_batch())
        count += 1
    elapsed = time.perf_counter() - start
    return {"batches_per_sec": round(count / elapsed, 1), "frames_per_sec": round(frames / elapsed)}


def _frames(x: torch.Tensor) -> int:
    return x.shape[0] * x.shape[1]


def stepper(source):
    """next_batch() over a source with get(step)."""
    state = {"step": 0}

    def next_batch():
        x = source.get(state["step"])[1]
        state["step"] += 1
        return x

    return next_batch


def measure_size(folder: Path, lengths, seconds: float) -> dict:
    store, _, _ = open_stores(folder, "train", "valid", seed=0)
    plan = BatchPlan(store.lengths, segment_lengths=[BASE_LENGTH], frames_per_step=FRAMES_PER_STEP, seed=0)
    batch_size = plan.batch_size(BASE_LENGTH)
    cpu = torch.device("cpu")
    out = {}
    for workers in (0, 2):
        loader = plain_loader(folder, lengths, BASE_LENGTH, batch_size, workers)
        batches = forever(loader)
        out[f"DataLoader, num_workers={workers}"] = rate(lambda b=batches: next(b), seconds)
    pre = Prefetcher(store, plan, cpu, start_step=0, depth=4, workers=1)
    out["prefetcher (memmap, depth 4, 1 worker)"] = rate(stepper(pre), seconds)
    pre.close()
    for name, dtype in (("cache (fp32, the default on a CPU)", torch.float32), ("cache (fp16)", torch.float16)):
        start = time.perf_counter()
        cache = DeviceFeatureCache(store, plan, cpu, max_bytes=1e12, dtype=dtype, show_progress=False)
        build = time.perf_counter() - start
        out[name] = rate(stepper(cache), seconds)
        out[name]["build_gb_per_sec"] = round(cache.cached_bytes / 1e9 / build, 2)
        cache.close()
    return out


def measure_lengths(folder: Path, seconds: float) -> dict:
    store, _, _ = open_stores(folder, "train", "valid", seed=0)
    cpu = torch.device("cpu")
    out = {}
    for L in SEGMENT_LENGTHS:
        plan = BatchPlan(store.lengths, segment_lengths=[L], frames_per_step=FRAMES_PER_STEP, seed=0)
        cache = DeviceFeatureCache(store, plan, cpu, max_bytes=1e12, dtype=torch.float32, show_progress=False)
        out[L] = {"batch_size": plan.batch_size(L), **rate(stepper(cache), seconds)}
        cache.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_utterances", type=int, default=1500)
    parser.add_argument("--scales", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per row")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_data.json"))
    args = parser.parse_args()
    load_at_start = round(os.getloadavg()[0], 2)
    torch.manual_seed(0)
    np.random.seed(0)
    result = {"command": command_line(), "machine": machine(),
              "load_average_1min_at_start": load_at_start,
              "dim": DIM, "segment_length": BASE_LENGTH, "frames_per_step": FRAMES_PER_STEP, "sizes": {}}
    for scale in args.scales:
        with tempfile.TemporaryDirectory(prefix="bench_data") as tmp:
            n = args.base_utterances * scale
            lengths = write_synthetic(Path(tmp), n)
            gb = lengths.sum() * DIM * 4 / 1e9
            print(f"{scale}x: {n} utterances, {lengths.sum():,} frames, {gb:.2f} GB fp32", file=sys.stderr)
            result["sizes"][f"{scale}x"] = {"utterances": n, "frames": int(lengths.sum()), "gb_fp32": round(gb, 2),
                                            "sources": measure_size(Path(tmp), lengths, args.seconds)}
            if scale == args.scales[0]:
                result["segment_lengths"] = measure_lengths(Path(tmp), args.seconds)
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"Batch assembly on {result['machine']}: {FRAMES_PER_STEP} frames per batch "
          f"({FRAMES_PER_STEP // BASE_LENGTH} crops of {BASE_LENGTH} frames, dim {DIM}), no model step.\n")
    sizes = list(result["sizes"])
    print("| source | " + " | ".join(f"{s} ({result['sizes'][s]['gb_fp32']} GB) frames/s" for s in sizes)
          + " | vs DataLoader (0 workers), largest |")
    print("|---" + "|---:" * (len(sizes) + 1) + "|")
    last = result["sizes"][sizes[-1]]["sources"]
    for source in result["sizes"][sizes[0]]["sources"]:
        cells = [f"{result['sizes'][s]['sources'][source]['frames_per_sec']:,}" for s in sizes]
        ratio = last[source]["frames_per_sec"] / last["DataLoader, num_workers=0"]["frames_per_sec"]
        print(f"| {source} | " + " | ".join(cells) + f" | {ratio:.1f}x |")
    fps = [v["frames_per_sec"] for v in result["segment_lengths"].values()]
    print(f"\nCache at each segment length ({sizes[0]} store, {FRAMES_PER_STEP} frames per batch); "
          f"spread (max-min)/max = {(max(fps) - min(fps)) / max(fps):.1%}\n")
    print("| segment length | batch size | batches/s | frames/s |")
    print("|---:|---:|---:|---:|")
    for L, row in result["segment_lengths"].items():
        print(f"| {L} | {row['batch_size']} | {row['batches_per_sec']} | {row['frames_per_sec']:,} |")
    result["segment_length_spread"] = round((max(fps) - min(fps)) / max(fps), 4)
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)  # other work on the machine skews figures
    print(f"\n1-minute load average: {result['load_average_1min_at_start']} at start, "
          f"{result['load_average_1min_at_end']} at end")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
