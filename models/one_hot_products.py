"""A compiler pass for the compiled training step on a CPU: the quantizer's products with a one-hot matrix of
the chosen codes become a gather and a scatter-add.

vector-quantize-pytorch's training forward multiplies by the one-hot matrix of each level's codes twice: the
quantized vectors (one-hot [frames x codes] times the codebook [codes x dim]) and the EMA sums (the level's
input transposed, [dim x frames], times the one-hot). Each is frames x codes x dim multiply-adds where frames x
dim of copying or adding is the same result. At the default codec (1024 codes of 160, 2,048 frames a step) on
2 CPU cores the compiled trainer ran 1.51x the eager trainer of before --compile with this pass, 1.27x without
(benchmarks/README.md, "The compiled step"). The pass rewrites them in the graph that torch.compile captures
(inductor's pre-grad custom pass), before autograd: the library's code is neither edited nor copied, and what
runs eager (the k-means init, eval, encode) is unchanged.

The quantized vectors are the codebook rows the one-hot picks, exactly; they pass through `kept`, so that the
backward uses them as computed rather than gathering again from a codebook that the forward's EMA update has
changed since. The EMA sums add the same numbers in another order (float rounding differs in the last bits). An
einsum is rewritten only when the operand is `F.one_hot(...)` cast to a float type and reshaped (rows kept
whole); the codes are read back from it with argmax, which inductor fuses with the one-hot's own comparison. A
library version whose einsums are written otherwise is left as it is (tests/test_compiled_step.py counts the
rewrites, so such an upgrade fails CI).
"""
from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import einops
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from models.graph_passes import replace_with_call, traced_value

# the library's einsums, whitespace normalised: the quantized vectors and the EMA sums
PICK_ROWS = "h b n ... c, h c d -> h b n ... d"  # one-hot [h, b, n, c] x codebook [h, c, d]
SUM_ROWS = "h n d, h n c -> h c d"  # input [h, n, d] x one-hot [h, n, c]
SHAPE_ONLY = {"reshape", "view"}  # methods that keep rows whole when the last dim is kept
# A product smaller than this (frames x codes x dim) is left as it is: it costs less than the gather, the copy and
# the scatter-add's calls (a codec this small, whose step is mostly host work, ran ~0.2 ms slower rewritten)
MIN_MULTIPLY_ADDS = 1 << 22


@torch.library.custom_op("rvq_seamless::kept", mutates_args=())
def kept(x: torch.Tensor) -> torch.Tensor:
    """A copy of x that autograd's partitioner saves for the backward rather than recomputes (an operator of
    its own is never recomputed). Recomputed, the codebook rows would be gathered again after the forward's EMA
    update has changed the codebook, and the commitment loss's gradient would move (~1e-3 relative, measured)."""
    return x.clone()


@kept.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def pick_rows(one_hot: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """einsum(PICK_ROWS, one_hot, codebook): the codebook row of each frame's code."""
    codes = one_hot.argmax(-1)
    heads, _, dim = codebook.shape
    rows = codebook.gather(1, codes.reshape(heads, -1, 1).expand(-1, -1, dim))
    return kept(rows).reshape(*codes.shape, dim).to(dtype)


def sum_rows(x: torch.Tensor, one_hot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """einsum(SUM_ROWS, x, one_hot): per code, the sum of the frames that chose it."""
    codes = one_hot.argmax(-1)
    heads, _, dim = x.shape
    sums = x.new_zeros(heads, one_hot.shape[-1], dim)
    return sums.scatter_add(1, codes.unsqueeze(-1).expand(-1, -1, dim), x).to(dtype)


def _is_one_hot(node) -> bool:
    """The node is F.one_hot(...) cast to a float type, through reshapes, views and slices that keep its last
    dim (each row stays one row of the one-hot)."""
    size = _last_dim(node)
    while isinstance(node, torch.fx.Node) and size is not None and _last_dim(node) == size:
        if node.op == "call_method" and node.target == "type":
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target is F.one_hot
        if node.op == "call_method" and node.target in SHAPE_ONLY:
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and _slices_rows(node.args[1]):
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and _unpacks_rows(node.args[0]):
            node = node.args[0].args[0]  # one tensor of an einops unpack (torch 2.11 keeps the call in the graph)
        else:
            return False
    return False


def _unpacks_rows(node) -> bool:
    """einops.unpack(tensor, shapes, pattern) with a named last axis: it splits and reshapes the leading dims and
    keeps each last-dim row whole."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is einops.unpack):
        return False
    pattern = node.args[2] if len(node.args) > 2 else node.kwargs.get("pattern")
    last = pattern.split()[-1] if isinstance(pattern, str) and pattern.split() else ""
    return last.isidentifier()


def _requires_grad(node) -> bool:
    """The codebook is trained by gradient (the library's learnable codebook): `kept` has no backward."""
    value = traced_value(node)
    return value is None or value.requires_grad


def _slices_rows(index) -> bool:
    """A getitem index of slices over leading dims only (no integer or tensor index, no step)."""
    index = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, slice) and i.step in (None, 1) for i in index) and len(index) >= 1


def _numel(node) -> int:
    value = traced_value(node)
    return 0 if value is None else value.numel()


def _last_dim(node) -> int | None:
    value = traced_value(node)
    return value.shape[-1] if value is not None and value.dim() else None


class OneHotProducts(CustomGraphPass):
    """Inductor's pre_grad_custom_pass: rewrites PICK_ROWS and SUM_ROWS einsums of a one-hot operand, of at
    least MIN_MULTIPLY_ADDS. `rewritten` counts them, summed over every graph it has run on."""

    def __init__(self):
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (torch.einsum, torch.functional.einsum):
                continue
            if len(node.args) != 3 or node.kwargs or not isinstance(node.args[0], str):
                continue
            equation, a, b = " ".join(node.args[0].split()), node.args[1], node.args[2]
            value = traced_value(node)
            if value is None:
                continue
            if equation == PICK_ROWS and _is_one_hot(a) and not _requires_grad(b):
                target, args, one_hot, other = pick_rows, (a, b, value.dtype), a, b
            elif equation == SUM_ROWS and _is_one_hot(b):
                target, args, one_hot, other = sum_rows, (a, b, value.dtype), b, a
            else:
                continue
            if _numel(one_hot) * (_last_dim(other) or 0) < MIN_MULTIPLY_ADDS:
                continue
            replace_with_call(graph, node, target, args)
            self.rewritten += 1

    def uuid(self) -> str:
        """Inductor's cache key for the pass: this file's contents and the size it rewrites from."""
        return hashlib.sha256(Path(__file__).read_bytes() + str(MIN_MULTIPLY_ADDS).encode()).hexdigest()
