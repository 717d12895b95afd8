"""The device feature cache: this rank's utterances packed into one tensor on the device.

A batch is a gather by index arithmetic on the device, with no host copy of
features. Utterances past `--gpu_cache_gb` are not cached; their crops are
assembled on the host and copied in, and the log says how much is cached.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from data.batch_plan import StepBatch
from data.crops import assemble_crops
from data.stores import FeatureStore

log = logging.getLogger(__name__)


class DeviceFeatureCache:
    def __init__(self, store: FeatureStore, plan, device: torch.device, *, max_bytes: float,
                 dtype: torch.dtype = torch.float16, show_progress: bool = True):
        self.store, self.plan, self.device, self.dtype = store, plan, device, dtype
        bytes_per_frame = store.dim * torch.tensor([], dtype=dtype).element_size()
        lengths = store.lengths
        fits = np.cumsum(lengths) * bytes_per_frame <= max_bytes
        self.num_cached = int(fits.sum())  # a prefix of the shard
        frames = int(lengths[: self.num_cached].sum())
        offsets = np.zeros(len(lengths), dtype=np.int64)
        offsets[1 : self.num_cached] = np.cumsum(lengths[: self.num_cached - 1]) if self.num_cached > 1 else []
        self.offsets = torch.from_numpy(offsets).to(device)
        self.features = torch.empty((frames, store.dim), dtype=dtype, device=device)
        start = time.perf_counter()
        row = 0
        for i in tqdm(range(self.num_cached), desc="building feature cache", disable=not show_progress,
                      leave=False, mininterval=1.0):
            n = int(lengths[i])
            # memory-mapped utterances are read-only: np.require copies them into a writable array
            rows = np.require(store.utterance(i), np.float32, requirements=["C", "W"])
            self.features[row : row + n] = torch.from_numpy(rows).to(device, dtype)
            row += n
        seconds = max(time.perf_counter() - start, 1e-9)
        self.cached_bytes = frames * bytes_per_frame
        log.info(
            "feature cache on %s: %d of %d utterances (%.2f GB, %s), built at %.2f GB/s%s",
            device, self.num_cached, len(lengths), self.cached_bytes / 1e9, str(dtype).replace("torch.", ""),
            self.cached_bytes / 1e9 / seconds,
            "" if self.num_cached == len(lengths) else "; the rest is read from the store",
        )

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        batch = self.plan.batch(step)
        L = batch.segment_length
        cached = batch.utterances < self.num_cached
        out = torch.empty((len(batch.utterances), L, self.store.dim), dtype=torch.float32, device=self.device)
        if cached.any():
            utt = torch.from_numpy(batch.utterances[cached]).to(self.device)
            first = self.offsets[utt] + torch.from_numpy(batch.starts[cached]).to(self.device)
            rows = first[:, None] + torch.arange(L, device=self.device)[None, :]
            out[torch.from_numpy(np.flatnonzero(cached)).to(self.device)] = self.features[rows].float()
        if not cached.all():
            rest = np.flatnonzero(~cached)
            host = assemble_crops(self.store, batch.utterances[rest], batch.starts[rest], L)
            out[torch.from_numpy(rest).to(self.device)] = torch.from_numpy(host).to(self.device)
        return batch, out

    def close(self) -> None:
        """Free the device memory now, not when the garbage collector gets to it."""
        self.features = torch.empty(0)
        self.offsets = torch.empty(0)
