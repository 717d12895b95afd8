"""A compiler pass for the compiled training step on a CPU: a small 1-d convolution becomes one matrix product.

On a CPU PyTorch runs a float convolution of a batch through oneDNN, whose forward and backward cost a few
hundred microseconds a call on 2 cores at any size up to a few million multiply-adds: a small codec's 8
convolutions took 1.7 ms of its 4 ms compiled step (torch.profiler over 100 steps of the tiny codec of
benchmarks/README.md, "The compiled step"). Written as the product it is (the input's k shifted copies stacked,
[frames x (k x channels)], times the weight, [(k x channels) x out]), inductor fuses the stacking into one loop
and the product is one GEMM call, forward and backward. Under 2^22 multiply-adds a call every shape measured ran
faster as a product (1.04x-2.35x, `python benchmarks/bench_conv.py`); above it either wins, so the pass leaves
those as they are (a conv of the default codec makes 2,048 frames x 160 x 160 x 3 = 157M). The pass rewrites
the graph that torch.compile captures (inductor's pre-grad custom pass), before autograd: the eager step and
eval keep the convolution. The products add the same terms in another order (float
rounding differs in the last bits).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from models.graph_passes import replace_with_call, traced_value

# A convolution of at least this many multiply-adds (frames x in x out x kernel) is left as it is
MAX_MULTIPLY_ADDS = 1 << 22
ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")  # torch.conv1d's, in order
DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def conv1d_products(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """torch.conv1d(x, weight, bias, stride=1, padding=padding): x [B, in, T], weight [out, in, k]."""
    k = weight.shape[-1]
    length = x.shape[-1] + 2 * padding - k + 1
    padded = F.pad(x, (padding, padding)) if padding else x
    shifted = torch.stack([padded[..., i:i + length] for i in range(k)], dim=1)  # [B, k, in, T]
    # [out, k x in] @ [B, k x in, T]. Written as an einsum, the compiled graph on torch 2.11 read the quantizer's
    # codebook after the forward's EMA update had written it (inductor's schedule of the whole graph; found by
    # tests/test_compiled_step.py run on torch 2.11)
    y = weight.permute(0, 2, 1).reshape(weight.shape[0], -1) @ shifted.flatten(1, 2)
    return y if bias is None else y + bias[:, None]


def _one(value) -> int | None:
    """An int conv argument, or a one-element tuple or list of one, as an int (None otherwise)."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None


class ConvProducts(CustomGraphPass):
    """Inductor's pre_grad_custom_pass: rewrites each torch.conv1d of a batch ([B, in, T]) with stride 1, no
    dilation, one group and zero padding given as a number, of fewer than MAX_MULTIPLY_ADDS. `rewritten` counts
    them, summed over every graph it has run on."""

    def __init__(self):
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.conv1d or len(node.args) > len(ARGS):
                continue
            call = {**DEFAULTS, **dict(zip(ARGS, node.args)), **node.kwargs}
            x, weight, out = traced_value(call.get("input")), traced_value(call.get("weight")), traced_value(node)
            padding = _one(call["padding"])
            if (x is None or weight is None or out is None or x.dim() != 3 or padding is None
                    or (_one(call["stride"]), _one(call["dilation"]), call["groups"]) != (1, 1, 1)):
                continue
            if out.shape[0] * out.shape[-1] * weight.numel() >= MAX_MULTIPLY_ADDS:
                continue
            replace_with_call(graph, node, conv1d_products, (call["input"], call["weight"], call["bias"], padding))
            self.rewritten += 1

    def uuid(self) -> str:
        """Inductor's cache key for the pass: this file's contents and the size it rewrites up to."""
        return hashlib.sha256(Path(__file__).read_bytes() + str(MAX_MULTIPLY_ADDS).encode()).hexdigest()
