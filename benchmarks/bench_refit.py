"""The end-of-schedule codebook refit's time by the rows of its distance passes (models/codebook_ops.py,
REFIT_CHUNK), on this machine's CPU.

The default codec (8 levels x 1024 codes, latent 160, beam 4) on random 160-d features (the demo corpus's
dim), its codebooks from a k-means init on one batch, then `RVQCodec.refit_codebooks` with the trainer's
default iterations over utterances of 500 frames: for each chunk size in turn, in rounds, the refit's wall
time, with the same starting codebooks each time. Every chunk size must give the same codebooks, bit for bit.

    python benchmarks/bench_refit.py [--frames 90000] [--chunks 16384,4096] [--repeats 2] [--threads N]
        [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from models import codebook_ops  # noqa: E402
from models.codec import CodecConfig, RVQCodec  # noqa: E402
from training.config import CodebookConfig  # noqa: E402

UTTERANCE_FRAMES = 500


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=90000, help="training frames the refit reads (the demo: 89,109)")
    p.add_argument("--chunks", default="16384,4096", help="REFIT_CHUNK rows to time, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds, each timing every chunk size once")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_refit.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=160))
    model(torch.randn(4, 512, 160))  # the k-means init: codebooks as training starts them
    model.eval()
    start = model.codebook_state()
    utterances = list(torch.randn(args.frames, 160).split(UTTERANCE_FRAMES))
    iters = CodebookConfig().refit_iters
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{machine()}, {torch.get_num_threads()} torch threads, 1-min load {os.getloadavg()[0]:.2f}")
    print(f"refit of {model.config.num_quantizers} x {model.config.codebook_size} codes, beam "
          f"{model.config.beam_size}, {iters} iteration(s), {args.frames:,} frames\n")
    seconds = {c: [] for c in chunks}
    codebooks = {}
    for round_ in range(args.repeats):
        for chunk in chunks:
            model.restore_codebook_state(start)
            codebook_ops.REFIT_CHUNK["cpu"] = chunk
            began = time.perf_counter()
            model.refit_codebooks(utterances, iters, batch_frames=2048)
            seconds[chunk].append(round(time.perf_counter() - began, 2))
            state = model.codebook_state()
            reference = next(iter(codebooks.values()), state)
            if not all(torch.equal(a, b) for a, b in zip(reference, state, strict=True)):
                raise SystemExit(f"REFIT_CHUNK {chunk} gave other codebooks than {next(iter(codebooks))}")
            codebooks.setdefault(chunk, state)
            print(f"  round {round_ + 1}: REFIT_CHUNK {chunk}: {seconds[chunk][-1]:.2f} s", flush=True)
    first = chunks[0]
    print("\n| REFIT_CHUNK rows | refit s (each round) | best | vs " + f"{first} |\n|---:|---|---:|---:|")
    for chunk in chunks:
        print(f"| {chunk} | {', '.join(f'{s:.2f}' for s in seconds[chunk])} | {min(seconds[chunk]):.2f} | "
              f"{min(seconds[first]) / min(seconds[chunk]):.2f}x |")
    print("\nthe same codebooks from every chunk size")
    result = {"machine": machine(), "torch_threads": torch.get_num_threads(), "frames": args.frames,
              "iters": iters, "codec": "8 x 1024 codes, latent 160, beam 4 (defaults); k-means init on one batch",
              "load_average": os.getloadavg(), "seconds": {str(c): s for c, s in seconds.items()},
              "same_codebooks": True}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
