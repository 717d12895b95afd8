"""The codes a tool or the Python API writes with a codec: the levels kept, the beam, the integer type, the .km level,
and what a code shard records of them (`CodesSpec.settings`), from a request (`CodesRequest`: the command line's
flags, tools/codes_flags.py, or rvq_tokenizer's defaults)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path

import numpy as np
import torch

from data.audio.features import FRAME_RATE
from data.audio.pass_plan import device_defaults
from errors import COMMAND_LINE, Asker, BadInputError
from models.codec import RVQCodec
from models.codes import code_dtype
from rvq_tokenizer.codec_files import recorded_digest


@dataclasses.dataclass(frozen=True)
class CodesRequest:
    """The codes asked for (tools/codes_flags.py: the flags of add_codes_args); None: the codec's own (or no .km)."""

    num_quantizers: int | None
    beam_size: int | None
    batch_frames: int | None  # None: the device's default (data/audio/pass_plan.py DEVICE_DEFAULTS)
    km: int | None  # the level also written as NAME.km
    parquet: bool
    kbps: float | None = None  # the levels by the bitrate they make (never with num_quantizers)


@dataclasses.dataclass
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

    def with_levels(self, levels: int | None, asker: Asker) -> CodesSpec:
        """The same codes with the first `levels` of the codec's levels (None: these), as codes_spec would make them
        for that many: BadInputError, in the `asker`'s words, for levels the codec lacks or below a .km level."""
        if levels is None:
            return self
        q = kept_levels(levels, self.model.config.num_quantizers, asker)
        if self.km is not None and self.km > q:
            raise BadInputError(f"--km {self.km}: the codes have levels 1 to {q}")
        return dataclasses.replace(self, levels=q, settings={**self.settings, "levels": q})

    @property
    def bits_per_frame(self) -> float:
        """The codes' bits per feature frame: each kept level's bits, spread over `downsample` frames."""
        config = self.model.config
        return self.levels * math.log2(config.codebook_size) / config.downsample


def kept_levels(asked, levels: int, asker: Asker) -> int:
    """The levels kept of a codec's `levels`: all for None, else `asked`; BadInputError, in the `asker`'s words, for
    a count the codec does not have."""
    if asked is None:
        return levels
    if isinstance(asked, bool) or not isinstance(asked, numbers.Integral) or not 1 <= asked <= levels:
        raise BadInputError(f"{asker.option('num_quantizers', asked)}: this codec has levels 1 to {levels}")
    return int(asked)


def kbps_per_level(codebook_size: int, downsample: int) -> float:
    """Kilobits per second of audio one level of a codec's codes makes: log2(codebook) bits at its code frame rate."""
    return math.log2(codebook_size) * FRAME_RATE / downsample / 1000


def levels_making(kbps, codebook_size: int, downsample: int, num_quantizers: int) -> int | None:
    """The first k levels (1 <= k <= num_quantizers) whose codes make `kbps` kilobits per second of audio, or None
    when no whole number of them does (or `kbps` is no number)."""
    number = isinstance(kbps, numbers.Real) and not isinstance(kbps, bool)  # before any arithmetic: "1" or True
    levels = kbps / kbps_per_level(codebook_size, downsample) if number else math.nan
    whole = math.isfinite(levels) and abs(levels - round(levels)) < 1e-6
    return int(round(levels)) if whole and 1 <= round(levels) <= num_quantizers else None


def levels_for_kbps(kbps: float, config, asker: Asker) -> int:
    """The levels whose codes make `kbps` kilobits per second of audio; BadInputError, in the `asker`'s words,
    naming the rates this codec's levels make when none makes that one."""
    levels = levels_making(kbps, config.codebook_size, config.downsample, config.num_quantizers)
    if levels is None:
        step = kbps_per_level(config.codebook_size, config.downsample)
        rates = ", ".join(f"{step * k:g}" for k in range(1, config.num_quantizers + 1))
        raise BadInputError(f"{asker.option('kbps', kbps)}: this codec's levels make {rates} kbps ({step:g} kbps a "
                            f"level: {math.log2(config.codebook_size):g} bits at {FRAME_RATE / config.downsample:g} "
                            "code frames a second)")
    return levels


def codes_spec(request: CodesRequest, model: RVQCodec, state: dict, ckpt_path: Path,
               device: torch.device, asker: Asker = COMMAND_LINE) -> CodesSpec:
    """The codes asked for (the flags of add_codes_args, or rvq_tokenizer's keywords); BadInputError, in the
    `asker`'s words, for levels or a beam this codec lacks."""
    config = model.config
    asked = request.num_quantizers if request.kbps is None else levels_for_kbps(request.kbps, config, asker)
    q = kept_levels(asked, config.num_quantizers, asker)
    if request.km is not None and request.km > q:
        raise BadInputError(f"--km {request.km}: the codes have levels 1 to {q}")
    beam, dtype = request.beam_size or config.beam_size, code_dtype(config.codebook_size)
    if beam > config.codebook_size:  # the search keeps at most one sequence per code of the first level
        raise BadInputError(f"{asker.option('beam_size', beam)}: this codec has {config.codebook_size} codes a level, so the beam can "
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
