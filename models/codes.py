"""Codes as the codec gives them: how many frames an utterance's codes have, the integer type they are stored in,
codes back to features, and fairseq's label lines (.km) of one level. (Features to codes, several utterances a pass:
training/codec_passes.py.)

An utterance of T frames gives ceil(T / downsample) code frames: its tail is
padded by repeating its last frame up to a multiple of the codec's downsample;
decoding cuts the output back to T frames when told T. An utterance with a NaN or
Inf value has no codes: -1 at every frame and level (the codec's "no code", as past
an utterance's end).
"""
from __future__ import annotations

import numpy as np
import torch

from models.codec import RVQCodec

TAIL_PADDING = "each utterance's tail is padded by repeating its last frame to a multiple of downsample"


def code_dtype(codebook_size: int) -> np.dtype:
    """int16 when every code 0..codebook_size-1 fits, else int32."""
    return np.dtype(np.int16) if codebook_size - 1 <= np.iinfo(np.int16).max else np.dtype(np.int32)


def code_frames(lengths: np.ndarray, downsample: int) -> np.ndarray:
    """Code frames of utterances of `lengths` feature frames: ceil(T / downsample) each."""
    return -(-np.asarray(lengths, dtype=np.int64) // downsample)


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
