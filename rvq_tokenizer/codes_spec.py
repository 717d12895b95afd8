"""The codes a tool or the Python API writes with a codec: the levels kept, the beam, the integer type, the .km level,
and what a code shard records of them (`CodesSpec.settings`), from a request (`CodesRequest`: the command line's
flags, tools/codes_flags.py, or rvq_tokenizer's defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.audio.pass_plan import device_defaults
from errors import BadInputError
from models.codec import RVQCodec
from models.codes import code_dtype
from rvq_tokenizer.codec_files import recorded_digest


@dataclass(frozen=True)
class CodesRequest:
    """The codes asked for (tools/codes_flags.py: the flags of add_codes_args); None: the codec's own (or no .km)."""

    num_quantizers: int | None
    beam_size: int | None
    batch_frames: int | None  # None: the device's default (data/audio/pass_plan.py DEVICE_DEFAULTS)
    km: int | None  # the level also written as NAME.km
    parquet: bool


@dataclass
class CodesSpec:
    """The codes a tool writes with a codec: levels kept, beam, integer type, .km level; `settings` are what a
    code shard records and is resumed with."""

    model: RVQCodec
    levels: int
    beam: int
    dtype: np.dtype
    km: int | None
    batch_frames: int
    settings: dict

    @property
    def bits_per_frame(self) -> float:
        """The codes' bits per feature frame: each kept level's bits, spread over `downsample` frames."""
        config = self.model.config
        return self.levels * math.log2(config.codebook_size) / config.downsample


def codes_spec(request: CodesRequest, model: RVQCodec, state: dict, ckpt_path: Path,
               device: torch.device) -> CodesSpec:
    """The codes asked for by the flags of add_codes_args; BadInputError for levels this codec lacks."""
    config = model.config
    q = config.num_quantizers if request.num_quantizers is None else request.num_quantizers
    if not 1 <= q <= config.num_quantizers:
        raise BadInputError(f"--num_quantizers {q}: this codec has levels 1 to {config.num_quantizers}")
    if request.km is not None and request.km > q:
        raise BadInputError(f"--km {request.km}: the codes have levels 1 to {q}")
    beam, dtype = request.beam_size or config.beam_size, code_dtype(config.codebook_size)
    if beam > config.codebook_size:  # the search keeps at most one sequence per code of the first level
        raise BadInputError(f"--beam_size {beam}: this codec has {config.codebook_size} codes a level, so the beam can "
                            f"be {config.codebook_size} wide at most")
    settings = {"checkpoint": str(ckpt_path.resolve()), "step": state.get("step"),
                "codec_digest": recorded_digest(state), "levels": q,
                "codebook_size": config.codebook_size, "downsample": config.downsample, "dtype": dtype.name,
                "feature_dim": config.feature_dim, "beam_size": beam, "km_level": request.km}
    batch_frames = request.batch_frames or device_defaults(device.type).codec_batch_frames
    return CodesSpec(model, q, beam, dtype, request.km, batch_frames, settings)


def describe_codes(spec: CodesSpec) -> str:
    """The codes in words, for the log."""
    config = spec.model.config
    return (f"{spec.levels} of {config.num_quantizers} levels x {config.codebook_size} codes, downsample "
            f"{config.downsample}, {spec.dtype}"
            + (f", beam search {spec.beam} wide" if spec.beam > 1 else ", the nearest code at each level")
            + (f", level {spec.km} also as NAME.km" if spec.km else ""))
