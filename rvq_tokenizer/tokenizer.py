"""The Python API's tokenizer (rvq_tokenizer's module doc is its manual): a codec over audio
(rvq_tokenizer/audio_codec.py) driven from Python, audio in memory or in files -> codes -> features, and the checks
of what a caller passes, each refused in Python's words (errors.py PYTHON)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from data.audio.features import FRAME_RATE, MIN_SAMPLES, SAMPLE_RATE, BadAudio, model_input
from data.audio.pipeline import Window
from data.audio.sources import FileReader, Utterances, WavesInMemory
from errors import PYTHON, BadInputError
from models.codes import code_frames, decode_utterance
from rvq_tokenizer.audio_codec import AudioCodec, audio_codec
from rvq_tokenizer.codec_files import open_codec
from rvq_tokenizer.codes_spec import CodesRequest, kbps_per_level, levels_for_kbps
from rvq_tokenizer.pipeline_settings import default_pipeline
from rvq_tokenizer.trained_features import PRECISION_NAMES, FeatureFlags
from training.device import select_device

PCM_SCALES = {np.dtype(np.int16): 2.0 ** 15, np.dtype(np.int32): 2.0 ** 31}  # integer samples as soundfile reads them
SHORTEST_MS = f"{1000 * MIN_SAMPLES / SAMPLE_RATE:.0f} ms"  # the shortest audio that gives a frame
SHORTEST = f"at least {MIN_SAMPLES} samples at {SAMPLE_RATE} Hz ({SHORTEST_MS})"
RATES = (1_000, 384_000)  # the sample rates audio is recorded at, in Hz: one outside is a mistake (kHz, a count)
PCM_PEAK = 100.0  # float samples this loud are integer PCM values stored as floats, not samples in [-1, 1]
LOUD_PEAK = 2.0  # float samples beyond this (and below PCM_PEAK) are taken, with a warning


def open_tokenizer(source: str | os.PathLike, *, device: str, precision: str | None,
                   w2v_bert: str | os.PathLike | None) -> RVQTokenizer:
    """rvq_tokenizer.load's work (its doc)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source is of type {type(source).__name__}: give the path of a run's folder, one of its "
                         "checkpoint files, or a folder python -m tools.export wrote")
    path = Path(source)
    if not path.exists():
        raise ValueError(f"load({str(source)!r}): no such file or folder: give a run's folder (the trainer's output "
                         "folder), one of its checkpoint files, or a folder python -m tools.export wrote")
    if precision is not None and precision not in PRECISION_NAMES:
        raise ValueError(f"precision={precision!r}: give one of {', '.join(map(repr, PRECISION_NAMES))}, or leave it "
                         "out for the codec's own")
    flags = FeatureFlags(None, None, precision, None if w2v_bert is None else Path(w2v_bert), asker=PYTHON)
    try:
        where = select_device(device, asker=PYTHON)
        model, state, ckpt_path = open_codec(path, where, PYTHON)
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


@dataclasses.dataclass
class Waves:
    """What a caller passed as audio, ready for the model: a name for each utterance (`audio[3]`), its samples
    as the model takes them (mono float32 at 16 kHz), whether it came as a torch tensor (its results are tensors
    on the tokenizer's device), and whether the call was for one utterance (one result) or several (a list)."""

    keys: list[str]
    waves: list[np.ndarray]
    tensors: list[bool]
    single: bool

    def utterances(self) -> Utterances:
        return Utterances.listed(self.keys, self.waves, WavesInMemory())


class RVQTokenizer:
    """Audio -> codes -> features with one trained codec; made by `rvq_tokenizer.load`.

    Attributes: `sample_rate` (16000: the rate every waveform is resampled to, as tools.extract resamples a file),
    `frame_rate` (code frames per second of audio: 50 / downsample), `levels` (the codec's), `kbps_per_level`,
    `device`, and `info`
    (CodecInfo: what a code shard records of the codec and its codes).

    Audio, wherever a method takes it, is one of (numpy arrays or torch tensors, float samples in [-1, 1] or int16
    and int32 PCM, at any rate from 1,000 to 384,000 Hz):

    - one utterance: [samples], or [samples, channels] (soundfile's layout), or [1, samples]: one result;
    - several: a list (or tuple) of utterances, each [samples] or multi-channel ([channels, samples] or
      [samples, channels]: the shorter axis holds the channels), or a batch [batch, channels, samples] with
      `lengths=` (each utterance's samples, the rest padding): a list of results, in order.

    A multi-channel utterance's channels are averaged, as tools.extract averages a file's. A 2-D array of at most
    as many rows as columns, [2, 32000] say, is both one utterance of 2 channels and 2 utterances: it is refused,
    the error naming the two ways to say which. Numpy in, numpy out; a torch tensor in, a torch tensor out, on the
    tokenizer's device. Every error is a ValueError naming the argument (`audio[3]`, `sample_rate`, `levels=`).
    """

    def __init__(self, codec: AudioCodec):
        self._codec = codec
        settings = {**codec.codes, **codec.passes}
        self.info = CodecInfo(
            levels=settings["levels"], codebook_size=settings["codebook_size"],
            frame_rate_hz=FRAME_RATE / settings["downsample"], feature=settings["features"]["feature"],
            feature_dim=settings["feature_dim"], downsample=settings["downsample"], beam_size=settings["beam_size"],
            dtype=settings["dtype"], codec_digest=settings["codec_digest"], step=settings["step"], settings=settings)

    sample_rate = SAMPLE_RATE

    @property
    def frame_rate(self) -> float:
        """Code frames per second of audio (feature frames at 50 Hz, `downsample` to a code frame)."""
        return self.info.frame_rate_hz

    @property
    def levels(self) -> int:
        """The codec's levels: what `encode` keeps unless `levels=` asks for its first few."""
        return self.info.levels

    @property
    def kbps_per_level(self) -> float:
        """Kilobits per second of audio each level's codes make (log2(codebook) bits at `frame_rate`)."""
        config = self._codec.spec.model.config
        return kbps_per_level(config.codebook_size, config.downsample)

    @property
    def device(self) -> torch.device:
        """Where the codec (and w2v-BERT) computes, and where torch results are put."""
        return self._codec.spec.model.feature_mean.device

    def __repr__(self) -> str:
        i = self.info
        return (f"RVQTokenizer({i.feature} features -> {i.levels} levels x {i.codebook_size} codes at "
                f"{i.frame_rate_hz:g} Hz, codec {i.codec_digest}, on {self.device})")

    def encode(self, audio, sample_rate, *, lengths=None, levels: int | None = None, kbps: float | None = None):
        """The codes of audio: tools.tokenize's codes for files holding it, bit for bit.

        Args:
            audio: one utterance, a list of them, or a batch [batch, channels, samples] (the class doc).
            sample_rate: the audio's rate in Hz (16000, 44100 ...): one for all, or a list of one per utterance.
            lengths: with a batch, each utterance's samples (a list, array or tensor); without it, every row whole.
            levels: keep the codec's first `levels` levels (a lower bitrate), picked as `tools.tokenize
                --num_quantizers levels` picks them; None: all of them (`self.levels`).
            kbps: instead of levels, the first levels that make this many kilobits per second of audio
                (`self.kbps_per_level` a level), as `tools.tokenize --kbps` keeps them.

        Returns:
            [code frames, levels] integer codes (`info.dtype`) of one utterance, or a list of them, one per
            utterance in order; numpy arrays, or torch tensors on `self.device` for audio given as tensors. An
            utterance of T feature frames (50 a second) has ceil(T / downsample) code frames.

        Raises:
            ValueError: audio of another type, shape or dtype, empty or shorter than 35 ms, with NaN or Inf
                samples, float samples of integer PCM's scale, a sample rate outside 1,000-384,000 Hz, lengths
                that do not fit the batch, levels the codec lacks (or a rate none of its level counts makes).
                Nothing is encoded then.

        Example:
            >>> tokenizer = rvq_tokenizer.load("runs/mine")
            >>> codes = tokenizer.encode(wave, 44100)                      # [code frames, levels]
            >>> batch = tokenizer.encode(waves, 16000, lengths=n)          # waves: [batch, 1, samples]
            >>> coarse = tokenizer.encode(wave, 44100, levels=2)           # the first two levels
            >>> at_1k = tokenizer.encode(wave, 44100, kbps=1)              # the levels of 1 kbps
        """
        waves = audio_inputs(audio, sample_rate, lengths)
        codec = self._codec_keeping(levels, kbps)
        return self._results(waves, self._codes(codec, waves.utterances(), num_workers=0))

    def encode_files(self, paths, *, num_workers: int | None = None, levels: int | None = None,
                     kbps: float | None = None):
        """The codes of audio files, decoded by worker processes as tools.tokenize decodes them.

        Args:
            paths: one audio file's path (str or pathlib.Path: .wav, .flac, .ogg ..., what soundfile reads) or a
                list of them.
            num_workers: decoding processes (default: tools.tokenize's, the CPUs this process may use less one);
                0 decodes on a thread of this process, as inside a DataLoader worker, which cannot start processes.
            levels, kbps: as `encode`'s.

        Returns:
            numpy codes [code frames, levels] of one file, or a list of them, one per path in order: tools.tokenize's
            codes for those files listed in that order, bit for bit.

        Raises:
            ValueError: a path that is no file, a file that cannot be read (naming it and why; nothing is encoded
                then), num_workers below 0, levels the codec lacks (or a rate none of its level counts makes).

        Example:
            >>> codes = tokenizer.encode_files(sorted(Path("/data/audio").glob("*.flac")))
        """
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
        if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 0:
            raise ValueError(f"num_workers={num_workers!r}: give 0 or more")
        codec = self._codec_keeping(levels, kbps)
        codes = self._codes(codec, Utterances.listed(keys, files, FileReader(Path("/"))), num_workers=workers,
                            named=lambda item: f"{item.key} ({files[item.index]})")
        return codes[0] if single else codes

    def features(self, audio, sample_rate, *, lengths=None):
        """The features the codec was trained on, of audio: what tools.extract writes for it with the settings the
        codec records (the fbank, or w2v-BERT's layer), bit for bit.

        Args:
            audio, sample_rate, lengths: as `encode`'s.

        Returns:
            [frames, dim] features (50 frames a second) in the dtype of the codec's training dump, of one
            utterance or a list of them; numpy, or torch tensors on `self.device` for audio given as tensors.

        Raises:
            ValueError: as `encode`'s, for the audio.

        Example:
            >>> feats = tokenizer.features(wave, 16000)                    # [frames, 160] for fbank
        """
        waves = audio_inputs(audio, sample_rate, lengths)
        out: list[np.ndarray | None] = [None] * len(waves.waves)

        def keep(window: Window) -> None:
            for item in window.files:
                out[item.index] = item.features

        self._each_window(self._codec, waves.utterances(), 0, True, keep, lambda item: item.key)
        return self._results(waves, out)

    def decode(self, codes, frames=None):
        """The codec's reconstruction of features from codes, as `python -m tools.encode decode` writes it.

        Args:
            codes: one utterance's integer codes [code frames, levels] (all the codec's levels or its first few; a
                code of -1 adds nothing), as `encode` returns them, or a list of them.
            frames: the utterance's feature frame count (one, or a list of one per utterance), to cut the output
                to it; without it each code frame gives `downsample` frames.

        Returns:
            float32 features [frames, dim], or a list of them; numpy, or torch tensors on `self.device` for codes
            given as tensors.

        Raises:
            ValueError: codes of another type, dtype or shape, a level or a code the codec lacks, a frame count
                that its codes cannot stand for.

        Example:
            >>> features = tokenizer.decode(tokenizer.encode(wave, 16000))
        """
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
        tensors = [isinstance(item, torch.Tensor) for item in items]
        return self._results(Waves(keys, [], tensors, single), out)

    def _codec_keeping(self, levels, kbps) -> AudioCodec:
        """The codec, its codes cut to their first `levels`, or to those that make `kbps` (None: all); ValueError
        naming levels= or kbps= it lacks."""
        if levels is not None and kbps is not None:
            raise ValueError(f"levels={levels!r} and kbps={kbps!r}: give one of them (a bitrate is a count of levels)")
        try:
            if kbps is not None:
                levels = levels_for_kbps(kbps, self._codec.spec.model.config, PYTHON)
            return dataclasses.replace(self._codec, spec=self._codec.spec.with_levels(levels, PYTHON))
        except BadInputError as e:
            raise ValueError(str(e)) from None

    def _results(self, waves: Waves, arrays: list[np.ndarray]):
        """Each result as its input came (a tensor on this device for a tensor), one or a list."""
        out = [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) if tensor else a
               for a, tensor in zip(arrays, waves.tensors, strict=True)]
        return out[0] if waves.single else out

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

    def _codes(self, codec: AudioCodec, utterances: Utterances, num_workers: int,
               named: Callable = lambda item: item.key) -> list[np.ndarray]:
        """The codes of each of `utterances`, through tools.tokenize's pipeline: each window's codes queued as it
        comes, and all brought to the host at the end, so that on a GPU the codec of a window runs behind the
        next window's features."""
        queued = []

        def encode(window: Window) -> None:
            queued.append((window.files, *codec.encode(window.files)))

        self._each_window(codec, utterances, num_workers, False, encode, named)
        out: list[np.ndarray | None] = [None] * len(utterances.keys)
        for files, lengths, codes_back in queued:
            codes = codes_back()
            ends = np.cumsum(code_frames(lengths, self.info.downsample))
            for item, utterance in zip(files, np.split(codes, ends[:-1]), strict=True):
                out[item.index] = utterance
        return out

    @staticmethod
    def _each_window(codec: AudioCodec, utterances: Utterances, num_workers: int, on_host: bool,
                     use: Callable[[Window], None], named: Callable) -> None:
        """use(window) for each window of `utterances` with every utterance's features (data/audio/pipeline.py);
        ValueError naming (`named(item)`) the utterances a window could not compute, and why."""
        pipeline = codec.windows(utterances, num_workers=num_workers, on_host=on_host)
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


def audio_inputs(audio, sample_rate, lengths=None) -> Waves:
    """The utterances `audio` holds (RVQTokenizer's doc says how it is read), each as the model's input; ValueError
    naming the first argument or utterance that cannot serve."""
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise ValueError("audio is an empty list: give a waveform, or a list of waveforms")
        if lengths is not None:
            raise ValueError("lengths= goes with a batch [batch, channels, samples]: a list's waves are each whole")
        keys, items, layouts, single = [f"audio[{i}]" for i in range(len(audio))], list(audio), "either", False
    elif isinstance(audio, (np.ndarray, torch.Tensor)) and audio.ndim == 3:
        keys, items, single = [f"audio[{i}]" for i in range(audio.shape[0])], batch_rows(audio, lengths), False
        layouts = "channels first"
        if not items:
            raise ValueError(f"audio has shape {tuple(audio.shape)}: a batch of no utterances")
    else:
        if lengths is not None:
            raise ValueError("lengths= goes with a batch [batch, channels, samples]: give one utterance without it")
        keys, items, layouts, single = ["audio"], [audio], one_utterance_layout(audio), True
    rates = sample_rates(sample_rate, len(items), single)
    waves = [model_wave(key, x, rate, layouts) for key, x, rate in zip(keys, items, rates)]
    return Waves(keys, waves, [isinstance(x, torch.Tensor) for x in items], single)


def one_utterance_layout(x) -> str:
    """How a waveform given alone is laid out: 1-D, or 2-D [samples, channels] (more rows than columns) or
    [1, samples]; a 2-D array of 2 rows or more and as many columns at least is both one utterance of channels
    and a batch of utterances: ValueError saying the two ways to say which."""
    if not isinstance(x, (np.ndarray, torch.Tensor)) or x.ndim == 1:
        return "either"  # 1-D, or a type samples() refuses, naming it
    if x.ndim != 2:
        raise ValueError(f"audio has shape {tuple(x.shape)}: give one utterance [samples] or [samples, channels], "
                         "or several: a list of them, or a batch [batch, channels, samples]")
    rows, columns = x.shape
    if rows > columns:
        return "channels last"
    if rows == 1:
        return "channels first"
    shape = tuple(x.shape)
    raise ValueError(f"audio has shape {shape}: as [channels, samples] it is one utterance of {rows} channels, as "
                     f"[batch, samples] {rows} utterances. Say which: one utterance as [samples, channels] (audio.T) "
                     f"or a batch of one, [1, {rows}, samples] (audio[None]); {rows} utterances as a list (list(audio)) "
                     f"or a batch [{rows}, 1, samples] (audio[:, None])")


def batch_rows(batch, lengths) -> list:
    """The utterances of a batch [batch, channels, samples], each [channels, samples] cut to its `lengths` entry
    (None: whole); ValueError for lengths that are not one count of samples, 1 to the batch's, per utterance."""
    rows, samples = batch.shape[0], batch.shape[2]
    if lengths is None:
        return [batch[i] for i in range(rows)]
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    counts = np.asarray(lengths)
    if counts.shape != (rows,) or counts.dtype.kind not in "iu" or (counts < 1).any() or (counts > samples).any():
        raise ValueError(f"lengths={lengths!r}: give the samples of each of the batch's {rows} utterance(s), integers "
                         f"from 1 to its {samples} samples a row")
    return [batch[i, :, : int(n)] for i, n in enumerate(counts)]


def sample_rates(sample_rate, utterances: int, single: bool) -> list:
    """One rate per utterance: `sample_rate` for all, or the list given, one per utterance."""
    if isinstance(sample_rate, (list, tuple)):
        if single or len(sample_rate) != utterances:
            raise ValueError(f"sample_rate lists {len(sample_rate)} rates for {utterances} waveform(s): give one rate "
                             "for all, or one per waveform")
        return list(sample_rate)
    return [sample_rate] * utterances


def model_wave(name: str, x, rate, layout: str = "either") -> np.ndarray:
    """The waveform `x` at `rate` Hz as tools.extract makes a file's samples the model's input (data/audio/features.py
    model_input: channels averaged, soxr's resampling to 16 kHz); ValueError naming it (`name`) when it cannot
    serve."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"sample_rate {rate!r} of {name}: give its sample rate in Hz, a positive number such as "
                         f"{SAMPLE_RATE}")
    if not RATES[0] <= rate <= RATES[1]:
        in_hz = f" ({rate * 1000:g}, not {rate:g} kHz?)" if RATES[0] <= rate * 1000 <= RATES[1] else ""
        raise ValueError(f"sample_rate {rate!r} of {name}: give its sample rate in Hz, from {RATES[0]:,} to "
                         f"{RATES[1]:,}{in_hz}")
    try:
        return model_input(samples(name, x, layout), rate)
    except BadAudio as e:
        raise ValueError(f"{name} is {e} ({SHORTEST_MS})") from None


def samples(name: str, x, layout: str = "either") -> np.ndarray:
    """[samples, channels] float32 of a waveform, laid out as soundfile returns a file's (so that the channels are
    averaged in the same order): a 2-D `x` read as `layout` says ("channels first", "channels last", or "either":
    the shorter axis holds the channels); ValueError naming it for a type, shape, dtype or value that cannot serve.
    Float samples beyond LOUD_PEAK are taken with a warning; from PCM_PEAK on they are integer PCM's, refused."""
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
    if data.ndim == 1:
        data = data[:, None]
    elif layout == "channels first" or (layout == "either" and data.shape[0] < data.shape[1]):
        data = data.T
    finite = np.isfinite(data)
    if not finite.all():
        raise ValueError(f"{name} has NaN or Inf samples (the first at sample {int(np.argwhere(~finite)[0][0])}): "
                         "give finite samples")
    if x.dtype.kind == "f":
        peak = float(np.abs(data).max())
        if peak >= PCM_PEAK:
            raise ValueError(f"{name} has float samples up to {peak:,.0f}: float samples are read in [-1, 1], and "
                             "these are integer PCM values held as floats. Scale them (x / 32768 for 16-bit PCM, "
                             "x / 2**31 for 32-bit), or give the int16 or int32 array itself")
        if peak > LOUD_PEAK:
            warnings.warn(f"{name} has float samples up to {peak:.1f}, beyond [-1, 1]: taken as they are (the "
                          "fbank normalises each utterance's level, so a scale changes little), but float samples "
                          "are read in [-1, 1]: scaled by mistake?", stacklevel=callers_level())
    return np.ascontiguousarray(data)


def callers_level() -> int:
    """warnings.warn's stacklevel, from the function that calls this one, of the first frame outside this package:
    the line of the caller's own code that passed the audio."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    return level
