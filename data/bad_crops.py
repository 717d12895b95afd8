"""Non-finite frames, caught as they are read: the crop is dropped on the device, the utterance named once,
counted, and never drawn again.

No start reads the whole corpus (`python -m tools.check` does, when asked). Each step's per-crop mask is
computed on the device and kept; the host reads the masks once per log window, where the step timer
already synchronises.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from data.batch_plan import BatchPlan, StepBatch
from data.stores import FeatureStore

log = logging.getLogger(__name__)


def finite_crops(features: torch.Tensor) -> torch.Tensor:
    """[B] bool: the crops of [B, T, D] with no NaN or Inf, computed on the device (no host sync)."""
    return torch.isfinite(features).flatten(1).all(1)


class BadCrops:
    """This rank's dropped crops: `check` at each micro-batch, `collect` at log time."""

    def __init__(self, shard: FeatureStore, plan: BatchPlan):
        self.shard, self.plan = shard, plan
        self.dropped_crops = 0  # crops dropped so far on this rank
        self.bad_utterances: list[int] = []  # this rank's utterances found non-finite, in the order found
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []

    def check(self, batch: StepBatch, features: torch.Tensor) -> torch.Tensor:
        keep = finite_crops(features)
        self._pending.append((batch.utterances, keep))
        return keep

    def collect(self) -> tuple[int, list[int]]:
        """Read the masks kept since the last call (one host sync); name each utterance found for the first
        time and exclude it from the plan. Returns (crops dropped in the window, utterances newly found)."""
        if not self._pending:
            return 0, []
        keep = torch.cat([k for _, k in self._pending]).cpu().numpy()
        utterances = np.concatenate([u for u, _ in self._pending])
        self._pending.clear()
        dropped = int((~keep).sum())
        new = sorted(set(utterances[~keep].tolist()) - set(self.bad_utterances))
        for i in new:
            log.warning("non-finite values (NaN or Inf) in %s: its crops are dropped and it is not used again; "
                        "`python -m tools.check` lists every such utterance", self.shard.name(i))
        if new:
            self.bad_utterances.extend(new)
            self.plan.exclude(new)
        self.dropped_crops += dropped
        return dropped, new
