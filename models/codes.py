"""One utterance's features <-> its RVQ codes with a trained codec, and the integer type codes are stored in.

An utterance is encoded alone, in eval mode and float32, so its codes never
depend on its neighbours. An utterance of T frames gives ceil(T / downsample)
code frames: its tail is padded by repeating its last frame up to a multiple of
the codec's downsample; decoding cuts the output back to T frames when told T.
"""
from __future__ import annotations

import numpy as np
import torch

from models.codec import RVQCodec


def code_dtype(codebook_size: int) -> np.dtype:
    """int16 when every code 0..codebook_size-1 fits, else int32."""
    return np.dtype(np.int16) if codebook_size - 1 <= np.iinfo(np.int16).max else np.dtype(np.int32)


def pad_to_multiple(features: torch.Tensor, multiple: int) -> torch.Tensor:
    """[T, D] -> [ceil(T / multiple) * multiple, D], the tail padded by repeating the last frame."""
    missing = -features.shape[0] % multiple
    if missing == 0:
        return features
    return torch.cat([features, features[-1:].expand(missing, -1)])


def encode_utterance(model: RVQCodec, features: np.ndarray, num_quantizers: int | None = None) -> np.ndarray:
    """[T, D] features -> [ceil(T / downsample), q] int64 codes."""
    q = num_quantizers or model.config.num_quantizers
    if features.shape[0] == 0:
        return np.zeros((0, q), dtype=np.int64)
    device = model.feature_mean.device
    x = torch.from_numpy(np.array(features, dtype=np.float32)).to(device)  # a copy: store arrays are read-only memmaps
    codes = model.encode(pad_to_multiple(x, model.config.downsample), num_quantizers=q)
    return codes.cpu().numpy()


def decode_utterance(model: RVQCodec, codes: np.ndarray, frames: int | None = None) -> np.ndarray:
    """[T', q] codes -> [T' x downsample, D] features, cut to `frames` when given."""
    if codes.shape[0] == 0:
        return np.zeros((0, model.config.feature_dim), dtype=np.float32)
    device = model.feature_mean.device
    out = model.decode(torch.from_numpy(np.asarray(codes, dtype=np.int64)).to(device))
    return out[:frames].float().cpu().numpy()
