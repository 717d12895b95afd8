"""Audio files -> features, in file order and in windows of files, with the model fed by worker processes.

A torch DataLoader's `num_workers` processes read each file, average it to mono, resample it to 16 kHz and
compute the Seamless fbank (data/audio/features.py), ahead of the model and in file order; a thread takes
their output into windows, one window ahead of the model. A window is consecutive files, at most
`commit_files` of them and at most `commit_seconds` of audio (it closes as soon as it reaches either): what a
tool commits at once. For w2v-BERT the chunks of every file of a window are grouped into forward passes by
the caller's `passes` (tools.extract and tools.tokenize: sorted by length, at most --batch_seconds of padded
audio a pass, cut where padding and passes cost least: data/audio/pass_plan.py least_cost_passes); a window of several
passes' audio is what lets them be both full and little padded. The windows depend on the files alone
(cut_windows), and the passes on a window's chunks alone, so a run resumed at a window's first file meets the
passes of a run never stopped (padding changes a layer's last bits: the same bytes need the same passes).

Features come out as a dump of `dtype` stores them (float16 rounds them); a file that cannot be read, or whose
features are not finite in that dtype, is skipped with the reason. The time the model (the caller's thread)
waits for decoded audio is measured (`input_wait`), and so is the rest of its time and its writer's (`stages`), so
that a run's log says where its time went.

On a GPU the host stays off the device's critical path. The workers only decode and resample: the fbank of a
window's files is computed on the device, in batches of files sorted by length (TorchFbank.batch, at most
DEVICE_FBANK_SECONDS of padded audio each), and fed to w2v-BERT there. Each pass's output is cast to the dump's
dtype into one packed tensor on the device, checked finite there, and copied back in one piece into pinned
memory without waiting (`Window.ready` waits, on the thread that writes); or, for tools.tokenize, left on the
device for the codec, one wait a window for the finiteness of its files. Inputs from the host reach the device
from pinned memory (data/transfers.py to_device): a plain copy would wait for every kernel queued. On a CPU the
workers compute the fbank, as before: on the main thread it would take the model's one thread.

Which path computes the fbank follows the device's kind alone (FBANK_ON_DEVICE; FeatureWindows' fbank_on_device
forces it either way), not a recorded setting. Both are data/audio/fbank.py's torch front-end, the same fbank: a batch
and the device's FFT and sums round differently in the last bits (tested within 1e-4 of each other, the
front-ends' own tolerance, data/feature_settings.py), so each path's bytes are its own. A shard resumed on the
kind of device it was begun on meets the same path and the same batches (a function of a window's files) and
gets the bytes of a run never stopped; one begun on a GPU and resumed on a CPU holds rows of each path, as a
w2v-BERT shard resumed on another device already holds rows of two devices' arithmetic (the device is not a
setting either): the same features within that tolerance, not the same bits.

The workers end with the process that started them (`end_with_parent`): a main process SIGKILLed (the OOM
killer) leaves no worker blocked for good on a pipe no one reads, and none holds the shard's lock.
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data.audio.fbank import TorchFbank, feature_frames
from data.audio.features import SAMPLE_RATE, BadAudio, SeamlessFbank, W2vBertLayer
from data.audio.pass_plan import DEVICE_DEFAULTS, length_sorted_batches
from data.audio.sources import Utterances, read_group
from data.manifests import name_problem, shown_name
from data.transfers import host_copy, to_device, torch_dtype

WORKER_PREFETCH = 4  # files decoded ahead per worker; the window thread bounds the rest by files and seconds
# the kinds of device that compute the fbank of the model's input (module doc)
FBANK_ON_DEVICE = tuple(kind for kind, defaults in DEVICE_DEFAULTS.items() if defaults.fbank_on_device)
DEVICE_FBANK_SECONDS = 600.0  # padded audio per batch of the fbank on the device
# what the model's thread spends its time on (FeatureWindows.stages; a writer adds the last two): on a GPU, the
# fbank's and the passes' time is the host's, queueing the device's work, and a wait for the device
INPUT_WAIT = "waiting for decoded audio"
STAGES = (INPUT_WAIT, "fbank", "passes", "codec", "waiting for the writer")
# what a writer thread (data/resumable_shard.py write_windows) spends its time on
WRITER_STAGES = ("waiting for the copy back", "writing")


@dataclass
class AudioFile:
    """One utterance of the shard (a file of a folder): `features` once computed, or `skipped` with the reason."""

    index: int  # its position in the shard's list
    key: str  # its name in the outputs (data/audio/sources.py)
    samples: int = 0  # at 16 kHz
    wave: np.ndarray | None = field(default=None, repr=False)  # decoded, for the fbank on the device
    fbank: np.ndarray | None = field(default=None, repr=False)
    features: np.ndarray | torch.Tensor | None = field(default=None, repr=False)  # a tensor: FeatureWindows' on_host
    skipped: str | None = None

    @property
    def shown_key(self) -> str:
        """Its name as a line or a message can hold it (escaped where needed: data/manifests.py)."""
        return shown_name(self.key)

    @property
    def skip_line(self) -> str:
        """Its line in a shard's skipped list: its shown name, a tab, the reason."""
        return f"{self.shown_key}\t{self.skipped}\n"


@dataclass
class Window:
    """Files first..end-1 of the shard, each with its features or the reason it was skipped."""

    first: int
    end: int
    files: list[AudioFile]
    pending: Callable[[], None] | None = field(default=None, repr=False)  # the copy back to finish

    def ready(self) -> None:
        """Wait for the copy of the features to the host where one is under way (FeatureWindows on a GPU), and give
        each file its features or skip reason; at once otherwise."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()


def cut_windows(files: Iterable[AudioFile], commit_files: int, commit_seconds: float) -> Iterator[Window]:
    """Consecutive files as windows, each closed as soon as it holds `commit_files` files or `commit_seconds` of
    audio (a skipped file counts as a file of none): a function of the files alone, from any window's first."""
    window, seconds = [], 0.0
    for item in files:
        window.append(item)
        seconds += item.samples / SAMPLE_RATE
        if len(window) >= commit_files or seconds >= commit_seconds:
            yield Window(window[0].index, item.index + 1, window)
            window, seconds = [], 0.0
    if window:
        yield Window(window[0].index, window[-1].index + 1, window)


class DecodedFiles(Dataset):
    """Item g: the g-th run of utterances from `first` on (Utterances.groups: one, or a parquet row group's rows),
    each read and turned into the Seamless fbank (what a DataLoader worker runs); with no `fbank`, read only (its
    `wave`), for the device to compute the fbank."""

    def __init__(self, utterances: Utterances, first: int, fbank: SeamlessFbank | None):
        self.keys, self.entries, self.reader = utterances.keys, utterances.entries, utterances.reader
        self.runs, self.fbank = utterances.groups(first), fbank

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, g: int) -> list[AudioFile]:
        start, end = self.runs[g]
        items = [AudioFile(index, self.keys[index]) for index in range(start, end)]
        for item in items:
            item.skipped = name_problem(item.key)
        readable = [item for item in items if not item.skipped]
        for item, wave in zip(readable, read_group(self.reader, [self.entries[i.index] for i in readable]),
                              strict=True):
            try:
                if isinstance(wave, BadAudio):
                    raise wave
                item.samples = len(wave)
                if self.fbank is None:
                    item.wave = wave
                else:
                    item.fbank = self.fbank(wave)
            except BadAudio as e:
                item.skipped = str(e)
        return items


def prefetch(decoded: DecodedFiles) -> int:
    """Runs each worker decodes ahead: WORKER_PREFETCH files, or 2 runs of a parquet row group's rows."""
    return 2 if getattr(decoded.reader, "group", None) else WORKER_PREFETCH


def _as_is(item):
    return item


PR_SET_PDEATHSIG = 1  # prctl(2)
# forked, as end_with_parent assumes: Python 3.14's default, forkserver, makes them children of another process
WORKER_START = "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def end_with_parent(parent: int, worker_id: int) -> None:
    """A DataLoader worker's init: SIGKILL when the thread that forked it ends (the main thread of `parent`, so
    the process), or at once when `parent` is already gone. Linux only; elsewhere torch's own check remains."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


class FeatureWindows:
    """The shard's `utterances` (data/audio/sources.py) as windows of features: `windows(first)` from utterance
    `first` on.

    encoder: a W2vBertLayer, or None for the fbank itself; passes: W2vBertLayer's grouping of a window's chunks
    into forward passes. progress(files) is called as work is done, with the share of files done (fractions
    while a window's passes run), times `weight`. device: where the features are computed (default: the
    encoder's, else the CPU); fbank_on_device: whether the device computes the fbank from decoded audio (default:
    on a device of a kind in FBANK_ON_DEVICE, with the torch front-end) rather than the workers. on_host: each
    file's `features` an array on the host, after `window.ready()`; else a tensor on the device (tools.tokenize
    encodes them there), in the dump's dtype either way."""

    def __init__(self, utterances: Utterances, *, fbank: SeamlessFbank, encoder: W2vBertLayer | None,
                 dtype: str, num_workers: int, commit_files: int, commit_seconds: float,
                 passes: Callable[[np.ndarray], list[np.ndarray]] | None = None,
                 progress: Callable[[float], None] = lambda files: None, weight: float = 1.0,
                 device: torch.device | None = None, fbank_on_device: bool | None = None, on_host: bool = True):
        self.utterances, self.fbank, self.encoder = utterances, fbank, encoder
        self.dtype, self.num_workers = np.dtype(dtype), num_workers
        self.torch_dtype = torch_dtype(self.dtype)
        self.commit_files, self.commit_seconds, self.passes = commit_files, commit_seconds, passes
        self.progress, self.weight = progress, weight
        self.device = torch.device(device if device is not None else encoder.device if encoder else "cpu")
        if fbank_on_device is None:
            fbank_on_device = self.device.type in FBANK_ON_DEVICE and fbank.front_end == "torch"
        if fbank_on_device and fbank.front_end != "torch":
            raise ValueError(f"the {fbank.front_end} front-end cannot run on the device: only the torch one")
        self.device_fbank = TorchFbank(self.device) if fbank_on_device else None
        self.on_host = on_host
        # seconds of the caller's thread (STAGES) and of a writer's (WRITER_STAGES) by what they did: the log's account
        self.stages = dict.fromkeys((*STAGES, *WRITER_STAGES), 0.0)
        self.audio_seconds = 0.0  # of the files read

    @property
    def input_wait(self) -> float:
        """Seconds the caller's thread waited for decoded audio."""
        return self.stages[INPUT_WAIT]

    def windows(self, first: int) -> Iterator[Window]:
        """Windows of files first.. to the end, each with every file's features or skip reason (on the host once
        `ready()`)."""
        if first >= len(self.utterances.keys):
            return
        decoded = DecodedFiles(self.utterances, first, None if self.device_fbank else self.fbank)
        loader = DataLoader(decoded, batch_size=None,
                            num_workers=self.num_workers, collate_fn=_as_is,
                            prefetch_factor=prefetch(decoded) if self.num_workers else None,
                            worker_init_fn=functools.partial(end_with_parent, os.getpid()),
                            multiprocessing_context=WORKER_START if self.num_workers else None)
        ahead = WindowThread(iter(loader), self._cut)  # the workers start here, on the caller's thread
        try:
            while True:
                began = time.perf_counter()
                window = ahead.get()
                self.stages[INPUT_WAIT] += time.perf_counter() - began
                if window is None:
                    return
                self._compute(window)
                yield window
        finally:
            ahead.stop()

    def _cut(self, files: Iterator[list[AudioFile]]) -> Iterator[Window]:
        """Decoded files -> windows (on the window thread)."""
        return cut_windows(self._counted(files), self.commit_files, self.commit_seconds)

    def _counted(self, files: Iterator[list[AudioFile]]) -> Iterator[AudioFile]:
        for run in files:
            for item in run:
                self.audio_seconds += item.samples / SAMPLE_RATE
                if self.encoder is None:
                    self.progress(self.weight)  # the fbank is the feature: this file is done
                yield item

    def _compute(self, window: Window) -> None:
        """Every readable file's features as the dump's dtype stores them, packed in one tensor on the device and
        checked finite there as stored (float16 overflows to Inf); then handed over (module doc): a file whose
        features are not finite is skipped."""
        readable = [f for f in window.files if f.skipped is None]
        if self.encoder is not None and len(readable) < len(window.files):
            self.progress(self.weight * (len(window.files) - len(readable)))
        if not readable:
            return
        with torch.inference_mode():
            began = time.perf_counter()
            if self.device_fbank is not None:
                fbanks = self._device_fbanks(readable)
            else:
                fbanks = [torch.from_numpy(f.fbank) for f in readable]
            for item in readable:
                item.wave = item.fbank = None
            self.stages["fbank"] += time.perf_counter() - began
            began = time.perf_counter()
            if self.encoder is None:
                stored = to_device(torch.cat(fbanks), self.device).to(self.torch_dtype)
            else:
                stored = self.encoder.encode(fbanks, self.passes, dtype=self.torch_dtype,
                                             on_batch=lambda files: self.progress(self.weight * files))
            finite = stored.isfinite().all(dim=1)
            self.stages["passes"] += time.perf_counter() - began
        lengths = [len(f) for f in fbanks]
        firsts = np.cumsum([0, *lengths[:-1]])
        if not self.on_host:  # the files to encode are the finite ones: one wait for the device a window
            finite_files = np.logical_and.reduceat(finite.cpu().numpy(), firsts)
            for item, features, ok in zip(readable, torch.split(stored, lengths), finite_files, strict=True):
                self._keep(item, features, ok)
            return
        features_back, finite_back = host_copy(stored), host_copy(finite)

        def to_files() -> None:
            finite_files = np.logical_and.reduceat(finite_back(), firsts)
            for item, features, ok in zip(readable, np.split(features_back(), firsts[1:]), finite_files, strict=True):
                self._keep(item, features, ok)

        window.pending = to_files
        if self.device.type != "cuda":
            window.ready()

    def _keep(self, item: AudioFile, features, finite: bool) -> None:
        if finite:
            item.features = features
        else:
            item.skipped = f"malformed: the features have NaN or Inf values (as {self.dtype.name})"

    def _device_fbanks(self, files: list[AudioFile]) -> list[torch.Tensor]:
        """Each file's [feature frames, 160] float32 fbank, computed on the device from its decoded audio: files
        sorted by length in batches of at most DEVICE_FBANK_SECONDS of padded audio (a function of the files
        alone: a resumed window meets the same batches), each sent from pinned memory on a GPU."""
        samples = np.array([f.samples for f in files], dtype=np.int64)
        pinned = self.device.type == "cuda"
        out: list[torch.Tensor | None] = [None] * len(files)
        for batch in length_sorted_batches(samples, int(DEVICE_FBANK_SECONDS * SAMPLE_RATE)):
            waves = torch.zeros(len(batch), int(samples[batch].max()), pin_memory=pinned)
            for row, k in enumerate(batch):
                waves[row, : samples[k]] = torch.from_numpy(files[k].wave)
            features, _ = self.device_fbank.batch(waves, samples[batch])
            for row, k in enumerate(batch):
                out[k] = features[row, : feature_frames(int(samples[k]))]
        return out


class WindowThread:
    """`cut(items)`'s windows made on a thread from `items` (a DataLoader iterator), one window ahead of `get`.
    An exception there is raised by `get`; `stop` ends the thread at its next item."""

    def __init__(self, items: Iterator, cut: Callable[[Iterator], Iterator[Window]]):
        self.ready: queue.Queue = queue.Queue(maxsize=1)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(items, cut), name="audio windows", daemon=True)
        self.thread.start()

    def _run(self, items, cut) -> None:
        try:
            for window in cut(items):
                if not self._put(window):
                    return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            self._put(e)

    def _put(self, value) -> bool:
        while not self.stopped.is_set():
            try:
                self.ready.put(value, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Window | None:
        value = self.ready.get()
        if isinstance(value, BaseException):
            raise value
        return value

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)  # it may be waiting for a worker's file: the daemon thread ends with it
