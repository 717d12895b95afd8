"""The device feature cache: this rank's utterances packed into one tensor on the device.

A batch is a gather by index arithmetic on the device. The batch plan (a pure
function of seed, step, rank and world size, so resume stays exact) draws the
crops on the host; what crosses to the device each step is one int64 per crop
(its first row in the packed tensor), copied from pinned memory without
blocking, so the host never waits for the device. Utterances past
`--gpu_cache_gb` are not cached; their crops are assembled on the host and
copied in the same way (ahead of time by a Prefetcher when one is asked for),
and the log says how much is cached.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from data.batch_plan import StepBatch
from data.crops import CropReader
from data.prefetcher import Prefetcher
from data.stores import FeatureStore
from data.transfers import dtype_name, to_device

log = logging.getLogger(__name__)

BUILD_CHUNK_FRAMES = 1 << 16  # frames staged per host-to-device copy while building


class DeviceFeatureCache:
    def __init__(self, store: FeatureStore, plan, device: torch.device, *, max_bytes: float,
                 dtype: torch.dtype = torch.float16, show_progress: bool = True, stream: dict | None = None):
        """stream: Prefetcher options (start_step, depth, workers, pin_memory, persistent_workers) for the
        crops of utterances that do not fit; None: they are read on the calling thread."""
        self.store, self.plan, self.device, self.dtype = store, plan, device, dtype
        self.reader = CropReader(store)
        bytes_per_frame = store.dim * torch.tensor([], dtype=dtype).element_size()
        lengths = store.lengths
        fits = np.cumsum(lengths) * bytes_per_frame <= max_bytes
        self.num_cached = int(fits.sum())  # a prefix of the shard
        frames = int(lengths[: self.num_cached].sum())
        self._offsets = np.zeros(len(lengths), dtype=np.int64)  # first row of each cached utterance
        self._offsets[: self.num_cached] = np.cumsum(lengths[: self.num_cached]) - lengths[: self.num_cached]
        self.features = torch.empty((frames, store.dim), dtype=dtype, device=device)
        self._spans: dict[int, torch.Tensor] = {}  # segment length -> arange(L) on the device
        start = time.perf_counter()
        with tqdm(total=frames, desc="building feature cache", unit="frame", unit_scale=True,
                  disable=not show_progress, leave=False, mininterval=1.0) as bar:
            first = 0
            while first < self.num_cached:
                # a run of whole utterances, about BUILD_CHUNK_FRAMES frames, read and copied as one block
                last = first + 1
                row0 = int(self._offsets[first])
                while last < self.num_cached and self._offsets[last] - row0 < BUILD_CHUNK_FRAMES:
                    last += 1
                block = self.reader.read_whole(np.arange(first, last))
                n = block.shape[0]
                self.features[row0 : row0 + n] = to_device(block, device).to(dtype)
                bar.update(n)
                first = last
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the build time below is the real one
        seconds = max(time.perf_counter() - start, 1e-9)
        self.cached_bytes = frames * bytes_per_frame
        if self.num_cached == 0 and len(lengths):
            log.warning("feature cache on %s: nothing cached, the first utterance alone needs %.3g GB, over the "
                        "budget of %.3g GB (--gpu_cache_gb); every crop is %s", device,
                        lengths[0] * bytes_per_frame / 1e9, max_bytes / 1e9,
                        "streamed by the prefetcher" if stream is not None else "read from the store")
        log.info(
            "feature cache on %s: %d of %d utterances (%.2f GB, %s), built at %.2f GB/s%s",
            device, self.num_cached, len(lengths), self.cached_bytes / 1e9, dtype_name(dtype),
            self.cached_bytes / 1e9 / seconds,
            "" if self.num_cached == len(lengths) else
            "; the rest is streamed by the prefetcher" if stream is not None else "; the rest is read from the store",
        )
        # On a CPU the cache is in RAM: numpy gathers (and converts) on the calling thread, which is faster
        # than torch's OpenMP kernels for a batch this size and does not stall when the cores are busy.
        self._host_view = None
        if device.type == "cpu" and dtype in (torch.float16, torch.float32):
            self._host_view = self.features.view(torch.int16).numpy() if dtype == torch.float16 else \
                self.features.numpy()
        self._stream = None
        if stream is not None and self.num_cached < len(lengths):
            self._stream = Prefetcher(store, UncachedCrops(plan, self.num_cached), device, **stream)
        # prepare(): on CUDA a gather is device work, so its host side can run while the device is busy. Not
        # with a stream: the prefetcher hands out its batches in order, from buffers it reuses.
        self.ahead = device.type == "cuda" and self._stream is None
        self._ready: tuple[int, tuple[StepBatch, torch.Tensor]] | None = None

    def _span(self, length: int) -> torch.Tensor:
        if length not in self._spans:
            self._spans[length] = torch.arange(length, device=self.device)
        return self._spans[length]

    def prepare(self, step: int) -> None:
        """Start the batch of `step` now, for the next `get(step)`: the trainer calls it before the step's one
        host sync, so the host work of a gather (the plan's draw, the index copy, the kernel launches, ~0.5 ms
        on an H100's host) runs while the device still computes the step before, instead of while it waits.
        A no-op where the gather is not asynchronous device work (a CPU) or where a stream serves the step."""
        if self.ahead:
            self._ready = (step, self.get(step))  # one prepared and never taken is dropped (get pops it)

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        if self._ready is not None:
            (ready, prepared), self._ready = self._ready, None
            if ready == step:
                return prepared
        batch = self.plan.batch(step)
        L, dim = batch.segment_length, self.store.dim
        cached = batch.utterances < self.num_cached
        # the stream serves every step in order, an empty batch when all of a step's crops are cached
        streamed = self._stream.get(step)[1] if self._stream is not None else None
        if cached.all():
            return batch, self._gather(self._offsets[batch.utterances] + batch.starts, L)
        out = torch.empty((len(batch.utterances), L, dim), dtype=torch.float32, device=self.device)
        if cached.any():
            where = np.flatnonzero(cached)
            first = self._offsets[batch.utterances[where]] + batch.starts[where]
            out.index_copy_(0, to_device(where, self.device), self._gather(first, L))
        rest = np.flatnonzero(~cached)
        if streamed is None:
            streamed = to_device(self.reader.read(batch.utterances[rest], batch.starts[rest], L), self.device)
        out.index_copy_(0, to_device(rest, self.device), streamed)
        return batch, out

    def _gather(self, first_rows: np.ndarray, length: int) -> torch.Tensor:
        """`[B, length, D]` float32 crops starting at the given rows of the packed tensor."""
        if self._host_view is not None:
            rows = (first_rows[:, None] + np.arange(length)[None, :]).reshape(-1)
            crops = torch.from_numpy(np.take(self._host_view, rows, axis=0, mode="clip"))
            if self.dtype == torch.float16:  # torch widens float16 with vector code, numpy one value at a time
                crops = crops.view(torch.float16).float()
            return crops.view(len(first_rows), length, -1)
        first = to_device(first_rows.astype(np.int64, copy=False), self.device)
        rows = (first[:, None] + self._span(length)[None, :]).reshape(-1)
        crops = torch.index_select(self.features, 0, rows)
        return crops.view(len(first_rows), length, -1).float()

    def close(self) -> None:
        """Stop the streaming workers; free the device memory now, not when the garbage collector gets to it."""
        if self._stream is not None:
            self._stream.close()
        self.features = torch.empty(0)
        self._host_view = None
        self._ready = None
        self._spans.clear()


class UncachedCrops:
    """The batch plan restricted to the crops of uncached utterances (possibly none at a step)."""

    def __init__(self, plan, num_cached: int):
        self.plan, self.num_cached = plan, num_cached
        self.steps_per_epoch, self.segment_lengths, self.batch_size = plan.steps_per_epoch, plan.segment_lengths, \
            plan.batch_size

    def batch(self, step: int) -> StepBatch:
        batch = self.plan.batch(step)
        rest = batch.utterances >= self.num_cached
        return StepBatch(step, batch.segment_length, batch.utterances[rest], batch.starts[rest])
