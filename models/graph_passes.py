"""Inductor's pre-grad custom pass for the compiled CPU step: the graph rewrites of models/one_hot_products.py and
models/conv_products.py run in turn on the graph torch.compile captures (inductor takes one such pass)."""
from __future__ import annotations

import hashlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


def traced_value(node) -> torch.Tensor | None:
    """The tensor dynamo traced for a graph node (its fake value), or None."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def replace_with_call(graph: torch.fx.Graph, node: torch.fx.Node, target, args: tuple) -> None:
    """Put a call of target(*args) in node's place: its users read the new call, which keeps node's metadata
    (its traced value, its source stack)."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


class GraphPasses(CustomGraphPass):
    """Runs each pass in turn; its cache key is made of theirs."""

    def __init__(self, *passes: CustomGraphPass):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> str:
        return hashlib.sha256("".join(str(p.uuid()) for p in self.passes).encode()).hexdigest()
