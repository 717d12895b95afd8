"""Encoding speed: `python -m tools.encode` with several utterances per forward pass against one at a time.

A synthetic fairseq dump (random features at 50 Hz; utterances of 2-20 s as in read speech, or --seconds)
and a freshly initialised codec of the default size (8 levels x 1024 codes, latent 160, downsample 1: the
speed does not depend on the weights), saved as a checkpoint; then the command itself, in this process,
over the whole split: `--batch_frames 1` puts every utterance alone in its forward pass, the others batch
length-sorted utterances up to that many padded frames. frames/s is the command's own timing of its
encoding loop: reading the features, encoding, writing and committing the codes. Every run must write the
same codes.

    python benchmarks/bench_encode.py [--feature_dim 1024] [--utterances 150] [--seconds 2,20]
        [--batch_frames 1,1024,2048,4096,16384] [--threads N] [--device auto] [--beam_size B] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from models.codec import CodecConfig, RVQCodec  # noqa: E402
from data.audio.pass_plan import length_sorted_batches  # noqa: E402
from tools import encode  # noqa: E402

FRAME_RATE = 50


def write_store(folder: Path, utterances: int, dim: int, seconds: tuple[float, float], seed: int = 0) -> int:
    """A fairseq dump `train_0_1.npy/.len` of random float32 features, utterances of uniformly drawn durations in
    `seconds`; returns its frames."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(int(seconds[0] * FRAME_RATE), int(seconds[1] * FRAME_RATE) + 1, size=utterances)
    with open(folder / "train_0_1.npy", "wb") as dump:
        np.lib.format.write_array_header_1_0(dump, {"descr": "<f4", "fortran_order": False,
                                                    "shape": (int(lengths.sum()), dim)})
        for n in lengths:
            dump.write(rng.standard_normal((int(n), dim), dtype=np.float32).tobytes())
    (folder / "train_0_1.len").write_text("".join(f"{n}\n" for n in lengths))
    return int(lengths.sum())


def write_checkpoint(path: Path, dim: int) -> None:
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=dim, kmeans_init=False))  # random codebooks: no k-means needed
    torch.save({"model": model.state_dict(), "codec": model.config.to_dict(), "step": 0}, path)


class EncodeTiming(logging.Handler):
    """Reads the frames/s tools.encode logs for its encoding loop."""

    def __init__(self):
        super().__init__()
        self.frames_per_sec = None

    def emit(self, record):
        m = re.match(r"encoded \d+ feature frames in [\d.]+ s: (\d+) frames/s", record.getMessage())
        if m:
            self.frames_per_sec = int(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--feature_dim", type=int, default=1024, help="1024: a w2v-BERT 2.0 layer; 160: Seamless fbank")
    p.add_argument("--utterances", type=int, default=150)
    p.add_argument("--seconds", default="2,20", help="shortest and longest utterance, uniformly drawn between")
    p.add_argument("--batch_frames", default="1,1024,2048,4096,16384", help="1 = one utterance per forward pass")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="tools.encode's --device: auto, cpu, cuda ...")
    p.add_argument("--beam_size", type=int, help="tools.encode's --beam_size (default: the codec's)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_encode.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = EncodeTiming()
    logging.getLogger("encode").addHandler(timing)
    logging.getLogger("encode").setLevel(logging.INFO)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seconds = tuple(float(x) for x in args.seconds.split(","))
        frames = write_store(tmp, args.utterances, args.feature_dim, seconds)
        write_checkpoint(tmp / "codec.pt", args.feature_dim)
        info = {"machine": machine(), "device": args.device, "torch_threads": torch.get_num_threads(),
                "load_average_before": [round(x, 2) for x in os.getloadavg()], "feature_dim": args.feature_dim,
                "beam_size": args.beam_size or CodecConfig(args.feature_dim).beam_size,
                "codec": "8 levels x 1024 codes, latent 160, downsample 1 (defaults), random weights",
                "utterances": args.utterances, "seconds": seconds, "frames": frames, "runs": []}
        print(f"{info['machine']}, {info['torch_threads']} torch threads, 1-min load {info['load_average_before'][0]}")
        print(f"{args.utterances} utterances of {seconds[0]:g}-{seconds[1]:g} s, {frames:,} frames of "
              f"{args.feature_dim}-d features ({frames / FRAME_RATE / 60:.1f} min)\n")
        print("| --batch_frames | forward passes | frames/s | speed-up |")
        print("|---:|---:|---:|---:|")
        codes = None
        for batch_frames in [int(b) for b in args.batch_frames.split(",")]:
            out = tmp / f"codes_{batch_frames}"
            beam = ["--beam_size", args.beam_size] if args.beam_size else []
            rc = encode.main(["--checkpoint", tmp / "codec.pt", "--data_dir", tmp, "--output_dir", out, "--device",
                              args.device, "--batch_frames", batch_frames, *beam])
            if rc != 0:
                raise SystemExit(f"tools.encode exited {rc}")
            written = np.load(out / "train_0_1.codes.npy")
            if codes is None:
                codes = written
            elif not np.array_equal(codes, written):
                raise SystemExit(f"--batch_frames {batch_frames} wrote other codes than the first run")
            lengths = np.loadtxt(tmp / "train_0_1.len", dtype=np.int64, ndmin=1)
            passes = forward_passes(lengths, batch_frames)
            run = {"batch_frames": batch_frames, "forward_passes": passes, "frames_per_sec": timing.frames_per_sec}
            info["runs"].append(run)
            base = info["runs"][0]["frames_per_sec"]
            print(f"| {batch_frames:,} | {passes:,} | {timing.frames_per_sec:,} | "
                  f"{timing.frames_per_sec / base:.2f}x |", flush=True)
        info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        print(f"\nsame codes in every run; 1-min load after: {info['load_average_after'][0]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def forward_passes(lengths: np.ndarray, batch_frames: int) -> int:
    """How many forward passes tools.encode makes over these utterances (its chunks, then its batches)."""
    commit_frames = encode.parse_args(["--checkpoint", "-", "--data_dir", "-", "--output_dir", "-"]).commit_frames
    return sum(len(length_sorted_batches(lengths[first:end], batch_frames))
               for _, first, end in encode.commit_chunks(lengths, commit_frames, 0))


if __name__ == "__main__":
    sys.exit(main())
