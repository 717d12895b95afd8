"""The multi-length batch plan: which crops each rank trains on at each step.

A pure function of (seed, epoch, step, rank, world size), so a resumed run sees
the same batches as one never stopped, and every rank agrees on the segment
length and on the number of steps per epoch whatever the size of its shard:
uneven step counts are the commonest cause of an all-reduce that waits forever.
An utterance excluded during the run (a bad frame in it) is left out from the
first step not drawn yet, so a batch once drawn (by a prefetcher, say) is the
same whenever it is drawn again.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from errors import BadInputError


@dataclass(frozen=True)
class StepBatch:
    """One rank's batch at one step: crops of `segment_length` frames."""

    step: int
    segment_length: int
    utterances: np.ndarray  # indices into the rank's shard
    starts: np.ndarray  # first frame of each crop

    @property
    def frames(self) -> int:
        return self.segment_length * len(self.utterances)


def shard_indices(num_utterances: int, rank: int, world_size: int) -> np.ndarray:
    """The utterances a rank owns: every world_size-th, starting at rank."""
    return np.arange(rank, num_utterances, world_size)


class BatchPlan:
    """Crops for training, `frames_per_step` frames per rank per step.

    lengths: frame counts of all training utterances (every rank passes the
    same array); the rank's shard is `shard_indices(len(lengths), rank, world)`.
    """

    def __init__(self, lengths, *, segment_lengths, frames_per_step: int, seed: int, rank: int = 0,
                 world_size: int = 1, multiple_of: int = 1):
        lengths = np.asarray(lengths, dtype=np.int64)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.frames_per_step = frames_per_step
        for length in segment_lengths:
            if length <= 0 or length % multiple_of:
                raise BadInputError(f"segment length {length} must be a positive multiple of --downsample {multiple_of}")
        shards = [lengths[shard_indices(len(lengths), r, world_size)] for r in range(world_size)]
        if min(len(s) for s in shards) == 0:
            raise BadInputError(f"{len(lengths)} training utterances cannot be shared among {world_size} ranks")
        shortest_needed = min(segment_lengths)
        if lengths.max() < shortest_needed:
            raise BadInputError(
                f"no training utterance is long enough: the longest has {int(lengths.max())} frames, "
                f"the shortest segment length is {shortest_needed}; lower --segment_length/--segment_lengths"
            )
        # A length is usable only if every rank owns an utterance that long, so that
        # all ranks can train on it at the same step.
        self.segment_lengths = sorted(L for L in segment_lengths if all(s.max() >= L for s in shards))
        self.dropped_lengths = sorted(set(segment_lengths) - set(self.segment_lengths))
        if not self.segment_lengths:
            raise BadInputError(
                f"no segment length in {sorted(segment_lengths)} fits an utterance on every one of {world_size} ranks"
            )
        self.too_short = int((lengths < shortest_needed).sum())
        self.total_frames = int(lengths.sum())
        self.steps_per_epoch = max(1, self.total_frames // (frames_per_step * world_size))
        self._mine = shards[rank]
        self._candidates = self._draw_tables()
        never = np.iinfo(np.int64).max
        self.excluded_from = np.full(len(self._mine), never, dtype=np.int64)  # per utterance: first step without it
        self._all_excluded_from = dict.fromkeys(self.segment_lengths, never)  # per length: then every one is drawn
        self._undrawn = 0  # the first step after every step drawn so far
        self._lock = threading.Lock()  # a prefetch worker draws while the main thread excludes

    def _draw_tables(self) -> dict:
        """Per segment length: (utterances, their lengths, cumulative draw weights); crops are drawn uniformly
        over frames, an utterance weighing (len - L + 1)."""
        mine, tables = self._mine, {}
        for L in self.segment_lengths:
            idx = np.flatnonzero(mine >= L)
            weight = (mine[idx] - L + 1).astype(np.float64)
            cdf = (weight / weight.sum()).cumsum()
            cdf /= cdf[-1]
            tables[L] = (idx, mine[idx], cdf)
        return tables

    def exclude(self, utterances) -> None:
        """Never draw these of this rank's utterances again (a bad frame was found in them), from the first
        step not drawn yet: a batch already drawn stays as it is. Only this rank's draws change: every rank
        keeps its steps, segment lengths and batch sizes. A length whose utterances are all excluded draws
        from all of them again (every rank must draw a batch at every length)."""
        utterances = np.asarray(utterances, dtype=np.int64)
        with self._lock:
            self.excluded_from[utterances] = np.minimum(self.excluded_from[utterances], self._undrawn)
            self._all_excluded_from = {L: int(self.excluded_from[idx].max())
                                       for L, (idx, _, _) in self._candidates.items()}

    def batch_size(self, segment_length: int) -> int:
        return max(1, self.frames_per_step // segment_length)

    def segment_length(self, step: int) -> int:
        """The same on every rank: drawn without the rank in the seed."""
        if len(self.segment_lengths) == 1:
            return self.segment_lengths[0]
        epoch = step // self.steps_per_epoch
        rng = np.random.default_rng([self.seed, epoch, step, self.world_size])
        return int(self.segment_lengths[rng.integers(len(self.segment_lengths))])

    def batch(self, step: int) -> StepBatch:
        L = self.segment_length(step)
        epoch = step // self.steps_per_epoch
        rng = np.random.default_rng([self.seed, epoch, step, self.rank, self.world_size, 1])
        idx, lens, cdf = self._candidates[L]
        with self._lock:  # an exclusion from now on leaves this step's batch as it is
            self._undrawn = max(self._undrawn, step + 1)
        # what rng.choice(len(idx), p=...) draws, without rebuilding the cumulative sum at every step
        pick = cdf.searchsorted(rng.random(self.batch_size(L)), side="right")
        if step < self._all_excluded_from[L]:  # a crop of an utterance excluded by this step is drawn again
            redraw = np.flatnonzero(self.excluded_from[idx[pick]] <= step)
            while len(redraw):
                pick[redraw] = cdf.searchsorted(rng.random(len(redraw)), side="right")
                redraw = redraw[self.excluded_from[idx[pick[redraw]]] <= step]
        starts = (rng.random(len(pick)) * (lens[pick] - L + 1)).astype(np.int64)
        return StepBatch(step, L, idx[pick], starts)


def eval_windows(lengths, window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Non-overlapping windows over utterances, for evaluation, by array arithmetic.

    Returns (utterance index, start) per window and the number of utterances
    shorter than one window, which are left out of evaluation.
    """
    counts = np.asarray(lengths, dtype=np.int64) // window
    utts = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = (np.arange(len(utts), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * window
    return utts, starts, int((counts == 0).sum())


def pick_windows(count: int, frames: int, window: int, *, seed: int, rank: int, world_size: int) -> np.ndarray:
    """Which of a rank's `count` windows it evaluates: its share of `frames` held-out frames over all ranks,
    drawn once from the seed, in order (all of them when `frames` is 0 or they are fewer)."""
    per_rank = -(-frames // (window * world_size))
    if frames == 0 or count <= per_rank:
        return np.arange(count, dtype=np.int64)
    return np.sort(np.random.default_rng([seed, rank, world_size, 2]).choice(count, per_rank, replace=False))


def pick_utterances(lengths, frames: int, *, seed: int, rank: int, world_size: int) -> np.ndarray:
    """Which of a rank's held-out utterances the final eval scores whole: drawn once from the seed until they
    hold its share of `frames` over all ranks (the last one crossing it), in order; all of them when `frames`
    is 0 or they hold fewer."""
    lengths = np.asarray(lengths, dtype=np.int64)
    per_rank = -(-frames // world_size)
    if frames == 0 or int(lengths.sum()) <= per_rank:
        return np.arange(len(lengths), dtype=np.int64)
    order = np.random.default_rng([seed, rank, world_size, 3]).permutation(len(lengths))
    take = int(np.searchsorted(np.cumsum(lengths[order]), per_rank)) + 1
    return np.sort(order[:take])
