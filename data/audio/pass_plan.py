"""How utterances are cut into forward passes, and the sizes each kind of device takes by default.

- The codec's passes (models' encode, the device's fbank): `length_sorted_batches`, shortest first, each filled up
  to a budget of padded frames.
- w2v-BERT's passes over a window's chunks: on a GPU `least_cost_passes`, cut where padding and passes cost least
  (`w2v_passes`, `PASS_RULE`); on a CPU each chunk is a pass of its own (`ALONE_RULE`), so that a chunk's features
  are the same bits alone and in any company (a pass's padding and its size change the last bits of its
  attention and its convolutions there: a code at a near tie flipped in 1 of 994 code frames), and no frame is
  padding; a shard begun before that rule was recorded keeps filling them in length order, with transformers' own
  attention (`w2v_attention`).
- `DEVICE_DEFAULTS`: per kind of device, the default sizes of those passes, of a shard's windows, and where the
  fbank of the model's input is computed.

The passes change a layer's last bits, so a shard records its rule (rvq_tokenizer/pipeline_settings.py
pass_settings) and a resumed shard meets the same passes: every rule here is a function of the lengths alone.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data.audio.features import FRAME_RATE
from data.audio.w2v_graphs import GRAPH_FRAMES, padded_frames


@dataclass(frozen=True)
class DeviceDefaults:
    """The defaults of one kind of device (benchmarks/README.md, "Extraction", "Padding", "Encoding speed")."""

    batch_seconds: float  # --batch_seconds: padded audio per w2v-BERT forward pass at most
    # --commit_seconds: w2v-BERT's passes are cut from one window's chunks sorted by length, so a window holds several
    # passes' audio for them to be both full and little padded; a killed run does one window again
    commit_seconds: float
    # --batch_frames: the codec's feature frames per pass; on a CPU the fastest pass measured, its intermediates
    # within the caches; on a GPU longer passes spread the kernel launches over more frames
    codec_batch_frames: int
    fbank_on_device: bool  # the model's device computes the fbank of its input, the decoding workers only decode
    # each w2v-BERT chunk its own pass (ALONE_RULE): on a CPU as fast as passes of many (none of their padding) and
    # the same bits in any company; a GPU needs the rows of many to be busy
    chunks_alone: bool


DEVICE_DEFAULTS = {"cpu": DeviceDefaults(batch_seconds=60.0, commit_seconds=600.0, codec_batch_frames=2048,
                                         fbank_on_device=False, chunks_alone=True),
                   "cuda": DeviceDefaults(batch_seconds=600.0, commit_seconds=3600.0, codec_batch_frames=32768,
                                          fbank_on_device=True, chunks_alone=False)}


def device_defaults(kind: str) -> DeviceDefaults:
    """The defaults of a kind of device (`torch.device.type`); a CPU's for a kind the table does not name."""
    return DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"])


def by_device(field: str) -> str:
    """A default as a flag's help says it: `60 on cpu, 600 on cuda`."""
    return ", ".join(f"{getattr(d, field):g} on {kind}" for kind, d in DEVICE_DEFAULTS.items())


# the work a w2v-BERT pass takes whatever its size (launches, host work), as a share of a full pass: a pass takes
# in a longer chunk only while the padding that adds costs less (least_cost_passes)
PASS_COST = 0.05
# how w2v_passes groups a window's chunks, for a shard's settings: other passes give a layer other last bits
PASS_RULE = f"least_cost_passes, a pass costing {PASS_COST:g} of --batch_seconds"
# the same in graph mode (data/audio/w2v_graphs.py), whose passes are planned on the chunks' padded lengths
GRAPH_PASS_RULE = f"{PASS_RULE}, each chunk padded to a multiple of {GRAPH_FRAMES} frames"
# each chunk a pass of its own (DeviceDefaults.chunks_alone)
ALONE_RULE = "each chunk alone"


def length_sorted_batches(lengths: np.ndarray, batch_frames: int) -> list[np.ndarray]:
    """Positions of `lengths` grouped into batches, shortest utterances first, each batch filled up to at most
    `batch_frames` once padded to its longest (rows x longest; an utterance longer than that goes alone): the
    codec's batches, whose padding is cheap beside w2v-BERT's (least_cost_passes)."""
    order = np.argsort(lengths, kind="stable")
    batches, first = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or (end + 1 - first) * int(lengths[order[end]]) > batch_frames:
            batches.append(order[first:end])
            first = end
    return batches


def least_cost_passes(lengths: np.ndarray, batch_frames: int, pass_frames: int) -> list[np.ndarray]:
    """Positions of `lengths` grouped into forward passes of neighbours in length order, shortest first, each at
    most `batch_frames` once padded to its longest (rows x longest; a longer one goes alone), cut where the
    passes cost least in all: a pass costs its padded frames plus `pass_frames`, the work a pass takes whatever
    its size (launches, host work). So a pass takes in a longer neighbour only where the padding that adds
    costs less than a pass of its own: few passes where lengths crowd, short ones where they are sparse.

    Exact, by dynamic programming over the sorted lengths (each end tries every start the budget allows), and a
    function of the lengths alone: the same chunks always meet the same passes, as a resumed shard needs."""
    order = np.argsort(lengths, kind="stable")
    ordered = np.asarray(lengths, dtype=np.int64)[order]
    index = np.arange(len(order) + 1, dtype=np.int64)
    cost = np.zeros(len(order) + 1, dtype=np.int64)  # cost[end]: the least cost of the `end` shortest
    start = np.zeros(len(order) + 1, dtype=np.int64)  # start[end]: where the last pass of that least cost begins
    for end in range(1, len(order) + 1):
        longest = max(1, int(ordered[end - 1]))
        first = max(0, end - max(1, batch_frames // longest))  # the budget's largest last pass
        # a last pass s..end-1 costs cost[s] + (end - s) x longest + pass_frames; the first of equals: the larger
        s = first + int(np.argmin(cost[first:end] - index[first:end] * longest))
        cost[end], start[end] = cost[s] + (end - s) * longest + pass_frames, s
    passes, end = [], len(order)
    while end > 0:
        passes.append(order[start[end] : end])
        end = int(start[end])
    return passes[::-1]


def w2v_attention(before_pass_rules: bool) -> str:
    """W2vBertLayer's attention for a shard: transformers' own for one begun before pass rules were recorded."""
    return "stock" if before_pass_rules else "fast"


def alone_passes(lengths: np.ndarray) -> list[np.ndarray]:
    """Each chunk a pass of its own, shortest first (ALONE_RULE)."""
    return [order[None] for order in np.argsort(lengths, kind="stable")]


def w2v_passes(seconds: float, *, before_pass_rules: bool = False, graphs: bool = False,
               alone: bool = False) -> Callable[[np.ndarray], list[np.ndarray]]:
    """w2v-BERT's forward passes over a window's chunks: with `alone` each chunk its own (alone_passes); else sorted by
    length, at most `seconds` of padded audio each, cut where padding and passes cost least, a pass costing
    PASS_COST of a full one (least_cost_passes), in graph mode on the lengths each chunk is padded to
    (data/audio/w2v_graphs.py); or, for a shard begun before pass rules were recorded, filled in that order
    (length_sorted_batches)."""
    if alone:
        return alone_passes
    frames = max(1, int(seconds * FRAME_RATE))
    if before_pass_rules:
        return functools.partial(length_sorted_batches, batch_frames=frames)
    plan = functools.partial(least_cost_passes, batch_frames=frames, pass_frames=int(PASS_COST * frames))
    if graphs:
        return lambda lengths: plan(padded_frames(np.asarray(lengths, dtype=np.int64)))
    return plan


def pass_rule(device_kind: str, graphs: bool) -> str:
    """The rule a new shard's passes follow on this kind of device, as its settings record it."""
    if graphs:
        return GRAPH_PASS_RULE
    return ALONE_RULE if device_defaults(device_kind).chunks_alone else PASS_RULE


def shard_passes(settings: dict) -> Callable[[np.ndarray], list[np.ndarray]]:
    """w2v_passes for a shard of these settings (pass_settings)."""
    return w2v_passes(settings["batch_seconds"], before_pass_rules="passes" not in settings,
                      graphs=settings.get("graphs") == "on", alone=settings.get("passes") == ALONE_RULE)
