"""The Python API's tokenizer (rvq_tokenizer's module doc is its manual): a codec over audio
(rvq_tokenizer/audio_codec.py) driven from Python, audio in memory or in files -> codes -> features, and the checks
of what a caller passes."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from data.audio.features import FRAME_RATE, MIN_SAMPLES, SAMPLE_RATE, BadAudio, model_input
from data.audio.pipeline import Window
from data.audio.sources import FileReader, Utterances, WavesInMemory
from errors import BadInputError
from models.codes import code_frames, decode_utterance
from rvq_tokenizer.audio_codec import AudioCodec, audio_codec
from rvq_tokenizer.codec_files import is_export, load_codec, load_exported
from rvq_tokenizer.codes_spec import CodesRequest
from rvq_tokenizer.pipeline_settings import default_pipeline
from rvq_tokenizer.trained_features import PRECISION_NAMES, FeatureFlags
from training.device import select_device

PCM_SCALES = {np.dtype(np.int16): 2.0 ** 15, np.dtype(np.int32): 2.0 ** 31}  # integer samples as soundfile reads them
SHORTEST_MS = f"{1000 * MIN_SAMPLES / SAMPLE_RATE:.0f} ms"  # the shortest audio that gives a frame
SHORTEST = f"at least {MIN_SAMPLES} samples at {SAMPLE_RATE} Hz ({SHORTEST_MS})"


def as_keyword(name: str, value=None) -> str:
    """An option (with its value) as a message names it here: load's keyword argument."""
    return name if value is None else f"{name}={str(value)!r}"


def open_tokenizer(source: str | os.PathLike, *, device: str, precision: str | None,
                   w2v_bert: str | os.PathLike | None) -> RVQTokenizer:
    """rvq_tokenizer.load's work (its doc)."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"load({str(source)!r}): no such file or folder: give a run's folder (the trainer's "
                         "--output_dir), one of its checkpoint files, or a folder python -m tools.export wrote")
    if precision is not None and precision not in PRECISION_NAMES:
        raise ValueError(f"precision={precision!r}: give one of {', '.join(map(repr, PRECISION_NAMES))}, or leave it "
                         "out for the codec's own")
    flags = FeatureFlags(None, None, precision, None if w2v_bert is None else Path(w2v_bert), named=as_keyword)
    try:
        where = select_device(device)
        model, state, ckpt_path = (load_exported if is_export(path) else load_codec)(path, where)
        codec = audio_codec(model, state, ckpt_path, CodesRequest(None, None, None, None, False), flags,
                            default_pipeline(str(where)), where, recorded=None)
    except BadInputError as e:
        raise ValueError(str(e)) from None
    return RVQTokenizer(codec)


@dataclasses.dataclass(frozen=True)
class CodecInfo:
    """A tokenizer's codec and its codes, with the values and names code shards record (NAME.codes.json)."""

    levels: int
    codebook_size: int  # codes 0 .. codebook_size - 1 at each level
    frame_rate_hz: float  # code frames per second of audio
    feature: str  # the features it codes: fbank or w2v-bert
    feature_dim: int
    downsample: int  # feature frames per code frame
    beam_size: int  # the width of the beam search that picks the codes
    dtype: str  # of the codes encode returns
    codec_digest: str  # of its weights: the same codec, the same digest, wherever its file lies
    step: int | None  # the training step of its checkpoint
    settings: dict = dataclasses.field(repr=False)  # what a code shard records of the codec, codes and features


class RVQTokenizer:
    """Audio -> codes -> features with one codec (module doc); made by `load`."""

    def __init__(self, codec: AudioCodec):
        self._codec = codec
        settings = {**codec.codes, **codec.passes}
        self.info = CodecInfo(
            levels=settings["levels"], codebook_size=settings["codebook_size"],
            frame_rate_hz=FRAME_RATE / settings["downsample"], feature=settings["features"]["feature"],
            feature_dim=settings["feature_dim"], downsample=settings["downsample"], beam_size=settings["beam_size"],
            dtype=settings["dtype"], codec_digest=settings["codec_digest"], step=settings["step"], settings=settings)

    @property
    def device(self) -> torch.device:
        return self._codec.spec.model.feature_mean.device

    def __repr__(self) -> str:
        i = self.info
        return (f"RVQTokenizer({i.feature} features -> {i.levels} levels x {i.codebook_size} codes at "
                f"{i.frame_rate_hz:g} Hz, codec {i.codec_digest}, on {self.device})")

    def encode(self, audio, sample_rate) -> np.ndarray | list[np.ndarray]:
        """The codes of one waveform, [code frames, levels], or of each of a list of them (module doc)."""
        keys, waves, single = audio_inputs(audio, sample_rate)
        codes = self._codes(Utterances.listed(keys, waves, WavesInMemory()), num_workers=0)
        return codes[0] if single else codes

    def encode_files(self, paths, *, num_workers: int | None = None) -> np.ndarray | list[np.ndarray]:
        """The codes of one audio file (.wav, .flac, .ogg ...: what soundfile reads), or of each of a list of them.
        num_workers: decoding processes (default: tools.tokenize's, the CPUs this process may use less one; 0
        decodes on a thread of this process, as inside a DataLoader worker, which cannot start processes)."""
        single = isinstance(paths, (str, os.PathLike))
        items = [paths] if single else list(paths)
        if not items:
            raise ValueError("paths is an empty list: give an audio file's path, or a list of them")
        keys = ["paths"] if single else [f"paths[{i}]" for i in range(len(items))]
        for key, item in zip(keys, items):
            if not isinstance(item, (str, os.PathLike)):
                raise ValueError(f"{key} is a {type(item).__name__}: give a path (str or pathlib.Path)")
            if not Path(item).is_file():
                raise ValueError(f"{key}: {item} is no file: give the path of an audio file (.wav, .flac, .ogg ...)")
        files = [os.path.abspath(item) for item in items]
        workers = self._codec.pipeline.num_workers if num_workers is None else num_workers
        if workers < 0:
            raise ValueError(f"num_workers={num_workers}: give 0 or more")
        codes = self._codes(Utterances.listed(keys, files, FileReader(Path("/"))), num_workers=workers,
                            named=lambda item: f"{item.key} ({files[item.index]})")
        return codes[0] if single else codes

    def features(self, audio, sample_rate) -> np.ndarray | list[np.ndarray]:
        """The features of one waveform, [frames, dim] in the dtype of the codec's training dump, or of each of a
        list of them: what tools.extract writes for that audio with the settings the codec records."""
        keys, waves, single = audio_inputs(audio, sample_rate)
        out: list[np.ndarray | None] = [None] * len(waves)

        def keep(window: Window) -> None:
            for item in window.files:
                out[item.index] = item.features

        self._each_window(Utterances.listed(keys, waves, WavesInMemory()), 0, True, keep, lambda item: item.key)
        return out[0] if single else out

    def decode(self, codes, frames=None) -> np.ndarray | list[np.ndarray]:
        """Features [frames, dim] float32 from one utterance's codes [code frames, levels] (the codec's levels, or
        its first few), or from each of a list of them: the codec's reconstruction, as tools.encode decode writes
        it. frames: the utterance's feature frames (one count, or one per utterance), to cut the output to them;
        without it each code frame gives `downsample` frames."""
        single = not isinstance(codes, (list, tuple))
        items = [codes] if single else list(codes)
        if not items:
            raise ValueError("codes is an empty list: give one utterance's codes [code frames, levels], or a list")
        keys = ["codes"] if single else [f"codes[{i}]" for i in range(len(items))]
        if frames is None:
            counts = [None] * len(items)
        elif single == isinstance(frames, (list, tuple)) or (not single and len(frames) != len(items)):
            raise ValueError(f"frames={frames!r}: give one count for one utterance's codes, or a list of one count "
                             f"per utterance ({len(items)})")
        else:
            counts = [frames] if single else list(frames)
        model, config = self._codec.spec.model, self._codec.spec.model.config
        arrays = [self._code_array(key, item) for key, item in zip(keys, items)]
        for key, array, n in zip(keys, arrays, counts):
            if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0
                                  or code_frames([n], config.downsample)[0] != len(array)):
                s = config.downsample
                raise ValueError(f"frames {n!r} for {key}: its {len(array)} code frames stand for "
                                 f"{max(0, (len(array) - 1) * s + 1)} to {len(array) * s} feature frames "
                                 f"(downsample {s}): give its feature frame count, or none")
        out = [decode_utterance(model, array, None if n is None else int(n)) for array, n in zip(arrays, counts)]
        return out[0] if single else out

    def _code_array(self, key: str, codes) -> np.ndarray:
        """`codes` as int64 [code frames, levels]; ValueError naming `key` unless the codec has those levels and
        values."""
        config = self._codec.spec.model.config
        if isinstance(codes, torch.Tensor):
            codes = codes.detach().cpu().numpy()
        elif not isinstance(codes, np.ndarray):
            raise ValueError(f"{key} is a {type(codes).__name__}: give a numpy array or a torch tensor of codes "
                             "[code frames, levels], as encode returns them")
        if codes.dtype.kind not in "iu":
            raise ValueError(f"{key} has dtype {codes.dtype}: give integer codes, as encode returns them "
                             f"({self.info.dtype})")
        if codes.ndim != 2 or not 1 <= codes.shape[1] <= config.num_quantizers:
            raise ValueError(f"{key} has shape {tuple(codes.shape)}: give [code frames, levels], the codec's "
                             f"{config.num_quantizers} levels or its first few")
        wrong = (codes < -1) | (codes >= config.codebook_size)
        if wrong.any():
            t, q = np.argwhere(wrong)[0]
            raise ValueError(f"{key} holds the code {codes[t, q]} at code frame {t}, level {q + 1}: this codec's "
                             f"codes are 0 to {config.codebook_size - 1} at each level (-1: none)")
        return codes.astype(np.int64)

    def _codes(self, utterances: Utterances, num_workers: int,
               named: Callable = lambda item: item.key) -> list[np.ndarray]:
        """The codes of each of `utterances`, through tools.tokenize's pipeline: each window's codes queued as it
        comes, and all brought to the host at the end, so that on a GPU the codec of a window runs behind the
        next window's features."""
        queued = []

        def encode(window: Window) -> None:
            queued.append((window.files, *self._codec.encode(window.files)))

        self._each_window(utterances, num_workers, False, encode, named)
        out: list[np.ndarray | None] = [None] * len(utterances.keys)
        for files, lengths, codes_back in queued:
            codes = codes_back()
            ends = np.cumsum(code_frames(lengths, self.info.downsample))
            for item, utterance in zip(files, np.split(codes, ends[:-1]), strict=True):
                out[item.index] = utterance
        return out

    def _each_window(self, utterances: Utterances, num_workers: int, on_host: bool, use: Callable[[Window], None],
                     named: Callable) -> None:
        """use(window) for each window of `utterances` with every utterance's features (data/audio/pipeline.py);
        ValueError naming (`named(item)`) the utterances a window could not compute, and why."""
        pipeline = self._codec.windows(utterances, num_workers=num_workers, on_host=on_host)
        windows = pipeline.windows(0)
        try:
            for window in windows:
                window.ready()
                failed = [item for item in window.files if item.skipped is not None]
                if failed:
                    raise ValueError("; ".join(f"{named(item)}: {item.skipped.rstrip('.')}" for item in failed)
                                     + f". Nothing was encoded: give readable audio of {SHORTEST} each, whose "
                                       "features are finite")
                use(window)
        finally:
            windows.close()


def audio_inputs(audio, sample_rate) -> tuple[list[str], list[np.ndarray], bool]:
    """(a name for each waveform, each as the model's input: mono float32 at 16 kHz, whether `audio` was one
    waveform rather than a list); ValueError naming the first that cannot serve."""
    single = not isinstance(audio, (list, tuple))
    items = [audio] if single else list(audio)
    if not items:
        raise ValueError("audio is an empty list: give a waveform, or a list of waveforms")
    if isinstance(sample_rate, (list, tuple)):
        if single or len(sample_rate) != len(items):
            raise ValueError(f"sample_rate lists {len(sample_rate)} rates for {len(items)} waveform(s): give one rate "
                             "for all, or one per waveform")
        rates = list(sample_rate)
    else:
        rates = [sample_rate] * len(items)
    keys = ["audio"] if single else [f"audio[{i}]" for i in range(len(items))]
    return keys, [model_wave(key, x, rate) for key, x, rate in zip(keys, items, rates)], single


def model_wave(name: str, x, rate) -> np.ndarray:
    """The waveform `x` at `rate` Hz as tools.extract makes a file's samples the model's input (data/audio/features.py
    model_input: channels averaged, soxr's resampling to 16 kHz); ValueError naming it (`name`) when it cannot
    serve."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"sample_rate {rate!r} of {name}: give its sample rate in Hz, a positive number such as "
                         f"{SAMPLE_RATE}")
    try:
        return model_input(samples(name, x), rate)
    except BadAudio as e:
        raise ValueError(f"{name} is {e} ({SHORTEST_MS})") from None


def samples(name: str, x) -> np.ndarray:
    """[samples, channels] float32 of a waveform, laid out as soundfile returns a file's (so that the channels are
    averaged in the same order); ValueError naming it for a type, shape, dtype or value that cannot serve."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = (x.float() if x.dtype == torch.bfloat16 else x).numpy()  # numpy has no bfloat16
    elif not isinstance(x, np.ndarray):
        raise ValueError(f"{name} is a {type(x).__name__}: give a numpy array or a torch tensor of samples")
    if x.ndim not in (1, 2):
        raise ValueError(f"{name} has shape {tuple(x.shape)}: give [samples], or [channels, samples] or "
                         "[samples, channels]")
    if x.dtype.kind == "f":
        data = x.astype(np.float32, copy=False)
    elif x.dtype in PCM_SCALES:
        data = x.astype(np.float32) / np.float32(PCM_SCALES[x.dtype])
    else:
        raise ValueError(f"{name} has dtype {x.dtype}: give float samples in [-1, 1] (float16, float32 or float64) "
                         "or integer PCM (int16 or int32)")
    if data.size == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): give {SHORTEST}")
    data = data[:, None] if data.ndim == 1 else data.T if data.shape[0] < data.shape[1] else data
    finite = np.isfinite(data)
    if not finite.all():
        raise ValueError(f"{name} has NaN or Inf samples (the first at sample {int(np.argwhere(~finite)[0][0])}): "
                         "give finite samples")
    return np.ascontiguousarray(data)
