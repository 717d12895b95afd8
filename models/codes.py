"""Utterances' features <-> their RVQ codes with a trained codec, the integer type codes are stored in, and
fairseq's label lines (.km) of one level.

An utterance of T frames gives ceil(T / downsample) code frames: its tail is
padded by repeating its last frame up to a multiple of the codec's downsample;
decoding cuts the output back to T frames when told T. Utterances are encoded
in eval mode and float32, several per forward pass: each row of a batch is
zero-padded past its end and RVQCodec.encode keeps the padding out of its
frames, so an utterance's codes are bit for bit those it gets alone. An utterance
with a NaN or Inf value has no codes: -1 at every frame and level (the codec's
"no code", as past an utterance's end), found on the device in each pass.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from data.bad_crops import finite_crops
from data.transfers import to_device, torch_dtype
from models.codec import RVQCodec

TAIL_PADDING = "each utterance's tail is padded by repeating its last frame to a multiple of downsample"


def code_dtype(codebook_size: int) -> np.dtype:
    """int16 when every code 0..codebook_size-1 fits, else int32."""
    return np.dtype(np.int16) if codebook_size - 1 <= np.iinfo(np.int16).max else np.dtype(np.int32)


def code_frames(lengths: np.ndarray, downsample: int) -> np.ndarray:
    """Code frames of utterances of `lengths` feature frames: ceil(T / downsample) each."""
    return -(-np.asarray(lengths, dtype=np.int64) // downsample)


def padded_rows(utterances: list[np.ndarray] | list[torch.Tensor], padded: np.ndarray, dim: int,
                multiple: int) -> torch.Tensor:
    """One pass's input: [rows, the longest padded length (at least `multiple`), dim] float32, row i utterance i
    widened to float32, its tail to padded[i] frames repeating its last frame, zeros after; built where the
    utterances lie (host arrays, maybe read-only float16 memmaps, copied on the host; tensors on their device)."""
    shape = (len(utterances), max(int(padded.max(initial=0)), multiple), dim)
    on_device = isinstance(utterances[0], torch.Tensor)
    rows = torch.zeros(shape, device=utterances[0].device) if on_device else np.zeros(shape, np.float32)
    for row, (features, n) in enumerate(zip(utterances, padded)):
        rows[row, : len(features)] = features
        rows[row, len(features) : n] = features[-1:]
    return rows if on_device else torch.from_numpy(rows)


def encode_rows(model: RVQCodec, utterances: list[np.ndarray] | list[torch.Tensor], num_quantizers: int | None = None,
                beam_size: int | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """[T_i, D] features of several utterances (host arrays, or tensors on the codec's device) -> (their int64
    codes [rows, longest, q] on the codec's device, from one pass, row i valid to padded[i] // downsample; the
    padded lengths). A row with a NaN or Inf value is encoded as one of no frames: the codec zeroes it at every
    layer and its codes are -1. Nothing waits for the device (beam_size: RVQCodec.encode's, by default the
    codec's)."""
    q = num_quantizers or model.config.num_quantizers
    s = model.config.downsample
    padded = code_frames([len(u) for u in utterances], s) * s
    device = model.feature_mean.device
    rows = to_device(padded_rows(utterances, padded, model.config.feature_dim, s), device)
    frames = to_device(padded, device).masked_fill(~finite_crops(rows), 0)
    return model.encode(rows, q, frames, beam_size=beam_size), padded


def encode_batch(model: RVQCodec, utterances: list[np.ndarray], num_quantizers: int | None = None,
                 beam_size: int | None = None) -> list[np.ndarray]:
    """[T_i, D] features of several utterances -> their [ceil(T_i / downsample), q] int64 codes on the host, in
    one pass (encode_rows)."""
    codes, padded = encode_rows(model, utterances, num_quantizers, beam_size)
    codes = codes.cpu().numpy()
    s = model.config.downsample
    return [codes[row, : n // s] for row, n in enumerate(padded)]


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


def encode_in_batches(model: RVQCodec, store, num_quantizers: int, batch_frames: int, dtype: np.dtype,
                      beam_size: int | None = None, on_batch: Callable[[np.ndarray], None] | None = None,
                      on_device: bool = False) -> np.ndarray | torch.Tensor:
    """Codes of every utterance of `store` (a data.stores.FeatureStore, or anything with `lengths` and
    `utterance(i)`: host arrays, or tensors on the codec's device), concatenated in order as `dtype`; encoded in
    length-sorted batches of at most `batch_frames` padded frames. on_batch(positions) after each batch: a
    caller's progress bar. on_device: the codes as a tensor on the codec's device, not waited for (a GPU caller
    copies them back where it needs them: data/transfers.py host_copy); else an array on the host."""
    s = model.config.downsample
    lengths = code_frames(store.lengths, s)
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = torch.empty(int(lengths.sum()), num_quantizers, dtype=torch_dtype(dtype), device=model.feature_mean.device)
    for batch in length_sorted_batches(lengths * s, batch_frames):
        codes, _ = encode_rows(model, [store.utterance(int(i)) for i in batch], num_quantizers, beam_size)
        for row, i in enumerate(batch):
            out[firsts[i] : firsts[i] + lengths[i]] = codes[row, : lengths[i]]
        if on_batch is not None:
            on_batch(batch)
    return out if on_device else out.cpu().numpy()


def km_lines(codes: np.ndarray, lengths: np.ndarray, level: int) -> str:
    """fairseq's label format (HuBERT's dump_km_label.py): one line per utterance, its codes at `level` (from 1)
    separated by spaces; `codes` are the utterances' [code frames, levels] concatenated, `lengths` their frames."""
    column = np.asarray(codes[:, level - 1])
    ends = np.cumsum(lengths)
    return "".join(" ".join(map(str, column[end - n : end].tolist())) + "\n" for n, end in zip(lengths, ends))


def uncoded(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Positions of the utterances with code frames but no codes (-1: features with NaN or Inf, encode_rows);
    `codes` are the utterances' [code frames, levels] concatenated, `lengths` their code frames."""
    starts = np.cumsum(lengths) - lengths
    coded = np.flatnonzero(lengths)
    return coded[np.asarray(codes)[starts[coded], 0] < 0]


def decode_utterance(model: RVQCodec, codes: np.ndarray, frames: int | None = None) -> np.ndarray:
    """[T', q] codes -> [T' x downsample, D] features, cut to `frames` when given."""
    if codes.shape[0] == 0:
        return np.zeros((0, model.config.feature_dim), dtype=np.float32)
    device = model.feature_mean.device
    out = model.decode(torch.from_numpy(np.asarray(codes, dtype=np.int64)).to(device))
    return out[:frames].float().cpu().numpy()
