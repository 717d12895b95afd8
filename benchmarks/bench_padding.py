"""Padding of w2v-BERT's forward passes: how much of each pass is padding, and how large the passes are.

No model and no audio: generated file lengths, seeded, for the length mixes a user meets (--files of each):

- `2-20 s`: uniform from 2 to 20 s (read and spontaneous speech cut into utterances);
- `LibriSpeech-like`: lognormal around 12 s, clipped to 1-35 s;
- `long files`: uniform from 1 to 30 minutes (podcasts, lectures), cut into equal chunks of at most
  --max_chunk_seconds by W2vBertLayer.chunks.

Each mix goes through the tools' own code: windows of files cut by data/audio/pipeline.py cut_windows, each
window's chunks grouped into passes, at each device's defaults (data/audio/pass_plan.py). The rules compared:
today's (length_sorted_batches: sorted, each pass filled up to --batch_seconds, in 600-s windows), a ratio cut
(a new pass when the longest chunk would exceed the shortest by 15%, up to --batch_seconds, in 600-s windows),
least_cost_passes in 600-s windows, and the tools' default (w2v_passes: least_cost_passes in the device's --commit_seconds
windows). For each: padding (padded frames that are not audio, per audio frame: the extra work), the padded
share (padding per padded frame), passes per window, audio seconds per pass (mean, 10th percentile, min, and
the size of the pass an audio second is in, on average), the largest padded pass, and the host time to cut a
window's passes.

    python benchmarks/bench_padding.py [--files 2000] [--seed 0] [--out benchmarks/results/bench_padding.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from data.audio.features import FRAME_RATE, SAMPLE_RATE, W2vBertLayer  # noqa: E402
from data.audio.pipeline import AudioFile, cut_windows  # noqa: E402
from data.audio.pass_plan import length_sorted_batches  # noqa: E402
from tools import extract  # noqa: E402
from data.audio.pass_plan import DEVICE_DEFAULTS, PASS_COST, w2v_passes  # noqa: E402
from rvq_tokenizer.pipeline_settings import COMMIT_FILES  # noqa: E402

MIXES = ("2-20 s", "LibriSpeech-like", "long files")
TODAY_COMMIT_SECONDS = 600.0  # the window before the devices' --commit_seconds, on every device
MAX_CHUNK_SECONDS = extract.build_parser().get_default("max_chunk_seconds")


def file_seconds(mix: str, files: int, seed: int = 0) -> np.ndarray:
    """Durations in seconds of `files` files of `mix`, drawn with `seed`."""
    rng = np.random.default_rng(seed)
    if mix == "2-20 s":
        return rng.uniform(2.0, 20.0, files)
    if mix == "LibriSpeech-like":
        return np.clip(rng.lognormal(math.log(12.0), 0.45, files), 1.0, 35.0)
    if mix == "long files":
        return rng.uniform(60.0, 1800.0, files)
    raise ValueError(f"no mix {mix!r}: one of {', '.join(MIXES)}")


def window_chunks(seconds: np.ndarray, commit_seconds: float, commit_files: int = COMMIT_FILES,
                  max_chunk_seconds: float = MAX_CHUNK_SECONDS) -> list[np.ndarray]:
    """The chunk lengths in frames of each window the tools cut from files of `seconds`."""
    files = [AudioFile(i, f"{i}.wav", samples=int(s * SAMPLE_RATE)) for i, s in enumerate(seconds)]
    chunker = SimpleNamespace(max_chunk=max(1, int(max_chunk_seconds * FRAME_RATE)))
    return [np.array([len(c) for f in window.files
                      for c in W2vBertLayer.chunks(chunker, np.empty((f.samples * FRAME_RATE // SAMPLE_RATE, 0)))],
                     dtype=np.int64)
            for window in cut_windows(files, commit_files, commit_seconds)]


def ratio_passes(lengths: np.ndarray, batch_frames: int, ratio: float = 1.15) -> list[np.ndarray]:
    """Sorted by length; a new pass when the next chunk would exceed the pass's shortest by `ratio`, or its padded
    frames `batch_frames`."""
    order = np.argsort(lengths, kind="stable")
    passes, first = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or (lengths[order[end]] > ratio * lengths[order[first]]
                                 or (end + 1 - first) * int(lengths[order[end]]) > batch_frames):
            passes.append(order[first:end])
            first = end
    return passes


def measure(windows: list[np.ndarray], passes: Callable[[np.ndarray], list[np.ndarray]]) -> dict:
    """Padding and pass sizes of `passes` over each window's chunk lengths; also checks that every chunk is in
    exactly one pass."""
    audio = padding = 0
    per_pass, counts, largest, seconds = [], [], 0, 0.0
    for lengths in windows:
        began = time.perf_counter()
        cut = passes(lengths)
        seconds += time.perf_counter() - began
        covered = np.sort(np.concatenate(cut)) if cut else np.zeros(0, np.int64)
        assert np.array_equal(covered, np.arange(len(lengths))), "a chunk missing or in two passes"
        counts.append(len(cut))
        for rows in cut:
            padded = len(rows) * int(lengths[rows].max())
            audio += int(lengths[rows].sum())
            padding += padded - int(lengths[rows].sum())
            largest = max(largest, padded)
            per_pass.append(lengths[rows].sum() / FRAME_RATE)
    per_pass = np.array(per_pass)
    return {"windows": len(windows), "audio_seconds": round(audio / FRAME_RATE, 1),
            "padding": round(padding / audio, 4), "padded_share": round(padding / (audio + padding), 4),
            "passes": len(per_pass), "passes_per_window": round(float(np.mean(counts)), 2),
            "pass_seconds_mean": round(float(per_pass.mean()), 1),
            "pass_seconds_audio_weighted": round(float((per_pass**2).sum() / per_pass.sum()), 1),
            "pass_seconds_p10": round(float(np.percentile(per_pass, 10)), 1),
            "pass_seconds_min": round(float(per_pass.min()), 1),
            "largest_pass_padded_seconds": round(largest / FRAME_RATE, 1),
            "cut_ms_per_window": round(1000 * seconds / max(1, len(windows)), 2)}


def rules(device: str) -> dict[str, tuple[float, Callable[[np.ndarray], list[np.ndarray]]]]:
    """name -> (window seconds, passes) of the rules compared on `device`'s defaults."""
    defaults = DEVICE_DEFAULTS[device]
    frames = int(defaults.batch_seconds * FRAME_RATE)
    compared = {"today: filled up to the budget": (TODAY_COMMIT_SECONDS,
                                                   functools.partial(length_sorted_batches, batch_frames=frames)),
                "ratio 1.15 cut": (TODAY_COMMIT_SECONDS, functools.partial(ratio_passes, batch_frames=frames))}
    if defaults.commit_seconds != TODAY_COMMIT_SECONDS:
        compared["least cost, today's windows"] = (TODAY_COMMIT_SECONDS, w2v_passes(defaults.batch_seconds))
    return {**compared, "least cost (default)": (defaults.commit_seconds, w2v_passes(defaults.batch_seconds))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000, help="files of each mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_padding.json")
    args = p.parse_args()
    results = {"machine": machine(), "files": args.files, "seed": args.seed, "pass_cost": PASS_COST,
               "batch_seconds": {kind: d.batch_seconds for kind, d in DEVICE_DEFAULTS.items()},
               "commit_seconds": {kind: d.commit_seconds for kind, d in DEVICE_DEFAULTS.items()},
               "today_commit_seconds": TODAY_COMMIT_SECONDS, "commit_files": COMMIT_FILES,
               "max_chunk_seconds": MAX_CHUNK_SECONDS, "runs": []}
    print("| mix | device (pass budget) | rule | window s | padding | padded share | passes / window | "
          "audio s / pass: mean | p10 | min | per audio s | cut ms / window |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mix in MIXES:
        seconds = file_seconds(mix, args.files, args.seed)
        for device in DEVICE_DEFAULTS:
            cut: dict[float, list[np.ndarray]] = {}
            for rule, (window, passes) in rules(device).items():
                if window not in cut:
                    cut[window] = window_chunks(seconds, window)
                m = measure(cut[window], passes)
                results["runs"].append({"mix": mix, "device": device, "rule": rule, "commit_seconds": window, **m})
                print(f"| {mix} | {device} ({DEVICE_DEFAULTS[device].batch_seconds:g} s) | {rule} | {window:g} | "
                      f"{100 * m['padding']:.1f}% | {100 * m['padded_share']:.1f}% | {m['passes_per_window']:.1f} | "
                      f"{m['pass_seconds_mean']:.0f} | {m['pass_seconds_p10']:.0f} | {m['pass_seconds_min']:.0f} | "
                      f"{m['pass_seconds_audio_weighted']:.0f} | "
                      f"{m['cut_ms_per_window']:.1f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
