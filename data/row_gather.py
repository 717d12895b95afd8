"""Rows of different lengths into a padded pass and back, in one gather and one scatter whatever the rows.

A pass's input is built by gathering from the rows packed one after another (`packed_rows`, with a row of zeros last
for the padding), its index made on the host (`padded_index`); its output goes back to where each row's frames
belong by one scatter of the valid positions (`valid_positions`). A row copied into place one at a time costs a few
ops a row, each a kernel launch on a GPU; these cost the same few ops for any number of rows, and copy the same
values."""
from __future__ import annotations

import numpy as np
import torch


def packed_rows(chunks: list[np.ndarray] | list[torch.Tensor]) -> np.ndarray | torch.Tensor:
    """The rows of `chunks` ([T_i, D] arrays, or tensors where they lie) one after another, then a row of zeros
    (what a pass's padding gathers): one array, or one tensor on the chunks' device."""
    if isinstance(chunks[0], torch.Tensor):
        return torch.cat([*chunks, chunks[0].new_zeros(1, chunks[0].shape[1])])
    return np.concatenate([*chunks, np.zeros((1, chunks[0].shape[1]), dtype=chunks[0].dtype)])


def padded_index(firsts: np.ndarray, lengths: np.ndarray, width: int, zero_row: int,
                 repeated: np.ndarray | None = None) -> np.ndarray:
    """[rows * width] int64: the packed row that each position of a [rows, width] pass takes. Row i's frame t is
    packed row firsts[i] + t for t < lengths[i]; past its end, up to repeated[i] (if given), its last frame again;
    then `zero_row`."""
    t = np.arange(width)
    firsts, lengths = firsts[:, None], lengths[:, None]
    index = np.where(t < lengths, firsts + t, zero_row)
    if repeated is not None:
        index = np.where((t >= lengths) & (t < repeated[:, None]), firsts + lengths - 1, index)
    return index.reshape(-1).astype(np.int64)


def valid_positions(firsts: np.ndarray, lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(each valid position of a [rows, width] pass, flat; the output row it belongs to): row i's frame t, for
    t < lengths[i], goes to row firsts[i] + t."""
    t = np.arange(width)
    valid = t < lengths[:, None]
    source = (np.arange(len(lengths))[:, None] * width + t)[valid]
    return source.astype(np.int64), (firsts[:, None] + t)[valid].astype(np.int64)
