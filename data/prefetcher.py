"""The prefetcher: worker threads assemble the next batches on the host while the step runs.

Up to `depth` batches are in flight (pinned memory when asked for, on CUDA).
An exception in a worker is raised in the main loop at that step's `get`, and
`close` stops the workers. Without persistent workers the pool is rebuilt at
each epoch boundary, as a DataLoader without `persistent_workers` does.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from data.batch_plan import StepBatch
from data.crops import assemble_crops
from data.stores import FeatureStore


class Prefetcher:
    def __init__(self, store: FeatureStore, plan, device: torch.device, *, start_step: int, depth: int = 4,
                 workers: int = 1, pin_memory: bool = False, persistent_workers: bool = True):
        self.store, self.plan, self.device = store, plan, device
        self.pin_memory = pin_memory and device.type == "cuda"
        self.depth, self.workers, self.persistent = max(1, depth), max(1, workers), persistent_workers
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prefetch")
        self._pending: deque = deque()
        self._next = start_step
        self._fill()

    def _build(self, step: int):
        batch = self.plan.batch(step)
        host = torch.from_numpy(assemble_crops(self.store, batch.utterances, batch.starts, batch.segment_length))
        return batch, host.pin_memory() if self.pin_memory else host

    def _fill(self) -> None:
        while len(self._pending) < self.depth:
            self._pending.append((self._next, self._pool.submit(self._build, self._next)))
            self._next += 1

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        queued, future = self._pending.popleft()
        if queued != step:
            raise RuntimeError(f"the prefetcher is out of step: expected {step}, queued {queued}")
        try:
            batch, host = future.result()
        except Exception as e:
            raise RuntimeError(f"the prefetcher failed while building step {step}: {e!r}") from e
        if not self.persistent and (step + 1) % self.plan.steps_per_epoch == 0:
            self._restart_pool()
        self._fill()
        return batch, host.to(self.device, non_blocking=self.pin_memory)

    def _restart_pool(self) -> None:
        old = self._pool
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prefetch")
        old.shutdown(wait=False)  # queued futures still complete on the old pool

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
