"""Assembling a batch of crops on the host, the path every other source falls back to."""
from __future__ import annotations

import numpy as np
import torch

from data.batch_plan import StepBatch
from data.stores import FeatureStore


def assemble_crops(store: FeatureStore, utterances, starts, length: int, out: np.ndarray | None = None) -> np.ndarray:
    """Copy `length`-frame crops into one float32 array `[B, length, D]`."""
    if out is None:
        out = np.empty((len(utterances), length, store.dim), dtype=np.float32)
    for k, (u, s) in enumerate(zip(utterances, starts)):
        out[k] = store.utterance(int(u))[int(s) : int(s) + length]
    return out


class HostBatches:
    """Batches read from the store on the main thread: the plain path, no cache, no prefetch."""

    def __init__(self, store: FeatureStore, plan, device: torch.device, pin_memory: bool = False):
        self.store, self.plan, self.device = store, plan, device
        self.pin_memory = pin_memory and device.type == "cuda"

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        batch = self.plan.batch(step)
        host = torch.from_numpy(assemble_crops(self.store, batch.utterances, batch.starts, batch.segment_length))
        if self.pin_memory:
            host = host.pin_memory()
        return batch, host.to(self.device, non_blocking=self.pin_memory)

    def close(self) -> None:
        pass
