"""A 1-d convolution's forward and backward on a CPU, compiled: PyTorch's convolution (oneDNN) against the matrix
product the compiled CPU step rewrites a small one into (models/conv_products.py), by size.

Each row is one convolution of the codec's shapes (stride 1, "same" padding) under torch.compile, forward and
backward of a mean-square loss, best of 3 timings; then the codec's whole chain of convolutions (the encoder's and
the decoder's, with their GELUs) at the tiny codec's and the default codec's sizes. The pass rewrites a convolution
of fewer than MAX_MULTIPLY_ADDS multiply-adds (frames x in x out x kernel).

    python benchmarks/bench_conv.py [--out benchmarks/results/bench_conv.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from models.conv_products import MAX_MULTIPLY_ADDS, conv1d_products  # noqa: E402

FRAMES = (64, 256, 1024, 2048)
SHAPES = ((16, 16, 3), (64, 64, 3), (160, 16, 3), (160, 160, 1), (160, 160, 3))  # in, out, kernel
# (crops, frames per crop, features, latent): the tiny codec of bench_step.py and the default codec's CPU batch
CHAINS = {"tiny codec (4 x 16 frames, 160 -> 16)": (4, 16, 160, 16),
          "default codec (32 x 64 frames, 160 -> 160)": (32, 64, 160, 160)}


def conv(x, weight, bias, padding):
    return F.conv1d(x, weight, bias, padding=padding)


def chain(fn):
    """The codec's convolutions in order (encoder: in, a residual block, out; decoder: in, a block, out)."""
    def loss(x, layers):
        h = x
        for i, (weight, bias) in enumerate(layers):
            h = fn(h, weight, bias, weight.shape[-1] // 2)
            h = F.gelu(h) if 0 < i < len(layers) - 1 else h
        return h.square().mean()
    return loss


def timed(fn, x, layers, calls: int) -> float:
    """Best of 3: microseconds per forward and backward."""
    for _ in range(3):
        fn(x, layers).backward()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x, layers).backward()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def compare(x: torch.Tensor, layers: list, multiply_adds: float) -> dict:
    calls = max(5, min(300, int(3e8 / multiply_adds)))
    result = {}
    for name, fn in (("convolution", conv), ("product", conv1d_products)):
        torch._dynamo.reset()
        result[name] = round(timed(torch.compile(chain(fn), dynamic=False), x, layers, calls))
    result["convolution / product"] = round(result["convolution"] / result["product"], 2)
    return result


def layer(c_in: int, c_out: int, kernel: int) -> tuple:
    return torch.randn(c_out, c_in, kernel, requires_grad=True), torch.randn(c_out, requires_grad=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_conv.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, chains = [], {}
    print("| frames | in -> out, kernel | multiply-adds | convolution µs | product µs | convolution / product "
          "| rewritten |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for frames in FRAMES:
        for c_in, c_out, kernel in SHAPES:
            length = 16 if frames < 1024 else 64
            x = torch.randn(frames // length, c_in, length, requires_grad=True)
            multiply_adds = frames * c_in * c_out * kernel
            row = {"frames": frames, "in": c_in, "out": c_out, "kernel": kernel, "multiply_adds": multiply_adds,
                   **compare(x, [layer(c_in, c_out, kernel)], multiply_adds)}
            rows.append(row)
            print(f"| {frames} | {c_in} -> {c_out}, {kernel} | {multiply_adds / 1e6:.2f}M | {row['convolution']} | "
                  f"{row['product']} | {row['convolution / product']:.2f} | "
                  f"{'yes' if multiply_adds < MAX_MULTIPLY_ADDS else 'no'} |", flush=True)
    print("\n| the codec's 8 convolutions, forward and backward | convolution µs | product µs "
          "| convolution / product |")
    print("|---|---:|---:|---:|")
    for name, (crops, length, features, latent) in CHAINS.items():
        shapes = [(features, latent, 3), (latent, latent, 3), (latent, latent, 1), (latent, latent, 1),
                  (latent, latent, 3), (latent, latent, 3), (latent, latent, 1), (latent, features, 3)]
        layers = [layer(*shape) for shape in shapes]
        multiply_adds = crops * length * sum(a * b * k for a, b, k in shapes)
        chains[name] = compare(torch.randn(crops, features, length), layers, multiply_adds)
        print(f"| {name} | {chains[name]['convolution']} | {chains[name]['product']} | "
              f"{chains[name]['convolution / product']:.2f} |", flush=True)
    result = {"machine": machine(), "threads": torch.get_num_threads(), "max_multiply_adds": MAX_MULTIPLY_ADDS,
              "convolutions": rows, "chains": chains}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
