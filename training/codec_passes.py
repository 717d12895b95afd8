"""Utterances' features to their codes with a trained codec, several utterances a pass.

An utterance of T frames gives ceil(T / downsample) code frames (models/codes.py code_frames): its tail is padded
by repeating its last frame up to a multiple of the codec's downsample. Utterances are encoded in eval mode and
float32, several per forward pass, in length-sorted batches (data/audio/pass_plan.py): each row of a batch is
zero-padded past its end and RVQCodec.encode keeps the padding out of its frames, so an utterance's codes are bit
for bit those it gets alone. An utterance with a NaN or Inf value has no codes: -1 at every frame and level (the
codec's "no code", as past an utterance's end), found on the device in each pass (data/bad_crops.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from data.audio.pass_plan import length_sorted_batches
from data.bad_crops import finite_crops
from data.row_gather import packed_rows, padded_index, valid_positions
from data.transfers import to_device, torch_dtype
from models.codec import RVQCodec
from models.codes import code_frames


def padded_rows(utterances: list[np.ndarray] | list[torch.Tensor], padded: np.ndarray, dim: int,
                multiple: int) -> torch.Tensor:
    """One pass's input: [rows, the longest padded length (at least `multiple`), dim] float32, row i utterance i
    widened to float32, its tail to padded[i] frames repeating its last frame, zeros after; built where the
    utterances lie (host arrays, maybe read-only float16 memmaps, on the host; tensors on their device), in one
    gather whatever the rows (data/row_gather.py)."""
    lengths = np.array([len(u) for u in utterances], dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    width = max(int(padded.max(initial=0)), multiple)
    packed = packed_rows(utterances)
    index = padded_index(firsts, lengths, width, len(packed) - 1, repeated=np.asarray(padded, dtype=np.int64))
    if isinstance(packed, torch.Tensor):
        rows = packed.index_select(0, to_device(index, packed.device)).float()
    else:
        rows = torch.from_numpy(packed[index].astype(np.float32, copy=False))
    return rows.view(len(utterances), width, dim)


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
    device = model.feature_mean.device
    out = torch.empty(int(lengths.sum()), num_quantizers, dtype=torch_dtype(dtype), device=device)
    for batch in length_sorted_batches(lengths * s, batch_frames):
        codes, _ = encode_rows(model, [store.utterance(int(i)) for i in batch], num_quantizers, beam_size)
        source, target = valid_positions(firsts[batch], lengths[batch], codes.shape[1])
        out.index_copy_(0, to_device(target, device),  # each row's codes into place, one scatter for the batch
                        codes.reshape(-1, num_quantizers).index_select(0, to_device(source, device)).to(out.dtype))
        if on_batch is not None:
            on_batch(batch)
    return out if on_device else out.cpu().numpy()
