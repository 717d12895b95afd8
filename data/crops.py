"""Assembling a batch of crops on the host, the path every other source falls back to."""
from __future__ import annotations

import numpy as np
import torch

from data.batch_plan import StepBatch
from data.stores import FeatureStore


class CropReader:
    """Crops of a store copied into one float32 array `[B, length, D]`.

    For a fairseq dump (utterances are row ranges of a few memory-mapped arrays, float32
    or float16) the crops are read with one `np.take` per shard on a row index built by arithmetic,
    instead of a Python loop over crops; a directory of files is read file by file.
    """

    def __init__(self, store: FeatureStore):
        self.store = store
        # the store's arrays, used as they are: no per-utterance work here
        self._arrays = all(isinstance(s, np.ndarray) and s.dtype in (np.float32, np.float16) for s in store.sources)
        self._shard, self._first, self._shards = store.shard, store.first, store.sources

    def read_whole(self, utterances) -> np.ndarray:
        """Whole utterances, concatenated: `[sum of their lengths, D]`, float16 from a float16 dump, else float32."""
        utterances = np.asarray(utterances, dtype=np.int64)
        if self._arrays and len(np.unique(self._shard[utterances])) == 1:
            lengths = self.store.lengths[utterances]
            within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            rows = np.repeat(self._first[utterances], lengths) + within
            return np.take(self._shards[self._shard[utterances[0]]], rows, axis=0)  # as stored: float16 stays
        return np.concatenate([np.asarray(self.store.utterance(int(i)), dtype=np.float32) for i in utterances])

    def read(self, utterances, starts, length: int, out: np.ndarray | None = None) -> np.ndarray:
        utterances = np.asarray(utterances, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        if out is None:
            out = np.empty((len(utterances), length, self.store.dim), dtype=np.float32)
        if not self._arrays:
            for k, (u, s) in enumerate(zip(utterances, starts)):
                out[k] = self.store.utterance(int(u))[int(s) : int(s) + length]
            return out
        first = self._first[utterances] + starts
        shard = self._shard[utterances]
        span = np.arange(length, dtype=np.int64)
        for k in np.unique(shard):
            mine = np.flatnonzero(shard == k)
            rows = (first[mine, None] + span[None, :]).ravel()
            if len(mine) == len(utterances):  # the usual case: one shard, written in place
                self._take(k, rows, out.reshape(-1, self.store.dim))
            else:
                part = np.empty((len(rows), self.store.dim), dtype=np.float32)
                out[mine] = self._take(k, rows, part).reshape(len(mine), length, -1)
        return out

    def _take(self, shard: int, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows of one shard into float32 `out` [rows, D]; float16 is gathered as 16-bit words and widened
        by torch (numpy's float16 cast is scalar code, 20x slower)."""
        source = self._shards[shard]
        if source.dtype == np.float32:
            return np.take(source, rows, axis=0, out=out, mode="clip")
        half = np.take(source.view(np.int16), rows, axis=0, mode="clip")
        torch.from_numpy(out).copy_(torch.from_numpy(half).view(torch.float16))
        return out


def assemble_crops(store: FeatureStore, utterances, starts, length: int, out: np.ndarray | None = None) -> np.ndarray:
    """Copy `length`-frame crops into one float32 array `[B, length, D]` (builds a CropReader each call)."""
    return CropReader(store).read(utterances, starts, length, out)


class HostBatches:
    """Batches read from the store on the main thread: the plain path, no cache, no prefetch."""

    def __init__(self, store: FeatureStore, plan, device: torch.device, pin_memory: bool = False):
        self.store, self.plan, self.device = store, plan, device
        self.reader = CropReader(store)
        self.pin_memory = pin_memory and device.type == "cuda"

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        batch = self.plan.batch(step)
        host = torch.from_numpy(self.reader.read(batch.utterances, batch.starts, batch.segment_length))
        if self.pin_memory:
            host = host.pin_memory()
        return batch, host.to(self.device, non_blocking=self.pin_memory)

    def prepare(self, step: int) -> None:
        """Nothing: the read is host work, done when the step asks for it (DeviceFeatureCache.prepare)."""

    def close(self) -> None:
        pass
