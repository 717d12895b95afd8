"""The prefetcher: worker threads assemble the next batches on the host while the step runs.

Up to `depth` batches are in flight. Each is assembled into a view of a host
buffer from a fixed pool per segment length, each buffer sized for that length's
largest batch (pinned when asked for, on CUDA) and reused, not allocated per
batch: the memory is bounded whatever batch shapes the steps bring. On CUDA the worker copies it to the device on a side
stream and records an event; the main stream waits on that event, so the step
never blocks the host, and the host buffer returns to the pool once the event
has completed. On CPU the buffer itself is the batch: it returns to the pool at
the next `get`, so a batch is valid until then.

An exception in a worker is raised in the main loop at that step's `get`, and
`close` stops the workers. Without persistent workers the pool is rebuilt at
each epoch boundary, as a DataLoader without `persistent_workers` does.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from data.batch_plan import StepBatch
from data.crops import CropReader
from data.stores import FeatureStore

log = logging.getLogger(__name__)


class HostBufferPool:
    """Reusable float32 host buffers, at most `per_length` per segment length, each for the largest batch at
    that length (`rows`); a batch is a view of its first rows. One goes back when the copy reading it is done.
    The memory is bounded by the plan's lengths, whatever batch shapes the steps bring."""

    def __init__(self, pin: bool, per_length: int, rows: dict, dim: int):
        self.pin, self.per_length, self.rows, self.dim = pin, per_length, rows, dim
        self.allocated = self.reused = 0
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self.per_length * sum(n * length * self.dim * 4 for length, n in self.rows.items())

    def acquire(self, length: int) -> torch.Tensor:
        """A `[rows[length], length, dim]` buffer: free, or new while fewer than `per_length` exist."""
        with self._lock:
            free = self._free.get(length, [])
            for k, (buffer, copied) in enumerate(free):
                if copied is None or copied.query():
                    del free[k]
                    self.reused += 1
                    return buffer
            self.allocated += 1
        return torch.empty((self.rows[length], length, self.dim), dtype=torch.float32, pin_memory=self.pin)

    def release(self, buffer: torch.Tensor, copied=None) -> None:
        """`copied`: the CUDA event after the copy that reads `buffer` (None: free now)."""
        with self._lock:
            free = self._free.setdefault(buffer.shape[1], [])
            if len(free) < self.per_length:
                free.append((buffer, copied))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class Prefetcher:
    def __init__(self, store: FeatureStore, plan, device: torch.device, *, start_step: int, depth: int = 4,
                 workers: int = 1, pin_memory: bool = False, persistent_workers: bool = True):
        self.store, self.plan, self.device = store, plan, device
        self.reader = CropReader(store)
        self.cuda = device.type == "cuda"
        self.depth, self.workers, self.persistent = max(1, depth), max(1, workers), persistent_workers
        rows = {length: plan.batch_size(length) for length in plan.segment_lengths}
        self.buffers = HostBufferPool(pin=pin_memory and self.cuda, per_length=self.depth + self.workers + 1,
                                      rows=rows, dim=store.dim)
        log.info("prefetcher: %d worker(s), %d batch(es) ahead, host buffers of at most %.3g GB%s", self.workers,
                 self.depth, self.buffers.max_bytes / 1e9, " (pinned)" if self.buffers.pin else "")
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._lent = None  # on CPU: the host buffer of the batch handed out last
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prefetch")
        self._pending: deque = deque()
        self._next = start_step
        self._fill()

    def _build(self, step: int):
        batch = self.plan.batch(step)
        buffer = self.buffers.acquire(batch.segment_length)
        host = buffer[: len(batch.utterances)]  # a view: the first rows of a buffer sized for the largest batch
        self.reader.read(batch.utterances, batch.starts, batch.segment_length, out=host.numpy())
        if not self.cuda:
            return batch, host, buffer
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            on_device = host.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        self.buffers.release(buffer, copied)
        return batch, on_device, copied

    def _fill(self) -> None:
        while len(self._pending) < self.depth:
            self._pending.append((self._next, self._pool.submit(self._build, self._next)))
            self._next += 1

    def get(self, step: int) -> tuple[StepBatch, torch.Tensor]:
        queued, future = self._pending.popleft()
        if queued != step:
            raise RuntimeError(f"the prefetcher is out of step: expected {step}, queued {queued}")
        if self._lent is not None:  # the previous batch's step is over: its buffer can be refilled
            self.buffers.release(self._lent)
            self._lent = None
        try:
            batch, x, done = future.result()  # done: the copy's CUDA event, or on CPU the buffer x is a view of
        except Exception as e:
            raise RuntimeError(f"the prefetcher failed while building step {step}: {e!r}") from e
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)  # the device waits for the copy, the host does not
            x.record_stream(main)  # allocated on the side stream, used and freed on the main one
        else:
            self._lent = done
        if not self.persistent and (step + 1) % self.plan.steps_per_epoch == 0:
            self._restart_pool()
        self._fill()
        return batch, x

    def prepare(self, step: int) -> None:
        """Nothing: the workers are ahead already (DeviceFeatureCache.prepare)."""

    def _restart_pool(self) -> None:
        old = self._pool
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="prefetch")
        old.shutdown(wait=False)  # queued futures still complete on the old pool

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.buffers.clear()
        self._lent = None
