"""Sync checks over the control plane: ranks compare where they are and what they hold.

At each check each rank contributes its step, epoch, samples seen, stop
request, whether its --max_minutes are up, the steps its clock says fit in
them, the steps to the next check, and a checksum of its codebooks; a mismatch
ends every rank with RanksDiverged (exit 3) naming the rank(s) and step. A stop
requested on any rank (a signal) becomes a stop on all of them; rank 0's clock
decides --max_minutes, the schedule's length under them, and the next check,
for every rank. One exchange carries every reason to stop.

A stop waits for the next check, so checks come by time, not only by step
(`CheckSchedule`): at every multiple of `--sync_check_every` and, when steps are
slow, about every STOP_CHECK_SECONDS in between. A scheduler allows about 30 s
from SIGTERM to SIGKILL; 50 steps of a second each would have taken all of it.
A check costs one small exchange and the checksum, milliseconds: well under 1%
of the seconds between checks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from training.distributed import DistContext, exchange
from errors import RanksDiverged

FIELDS = ("step", "epoch", "samples_seen", "stop", "out_of_time", "steps_in_time", "steps_to_next", "codebook_sum",
          "codebook_sq")
CHECKSUM_RTOL = 1e-6
STOP_CHECK_SECONDS = 2.0  # a sync check about this often when steps are slow: a stop is agreed within seconds


def codebook_checksum(codebooks) -> tuple[float, float]:
    """Two numbers that change when any codebook entry changes."""
    total, squares = 0.0, 0.0
    for level, embed in enumerate(codebooks):
        e = embed.detach().double()
        weights = torch.arange(1, e.shape[0] + 1, dtype=torch.float64, device=e.device)[:, None]
        total += float((e * weights).sum()) * (level + 1)
        squares += float((e * e).sum())
    return total, squares


class CheckSchedule:
    """The steps a sync check follows, the same on every rank: every multiple of --sync_check_every and, in
    between, about every STOP_CHECK_SECONDS at the pace rank 0 measured since the last check. The first comes
    after the first step (on a resume, the first of this run), whose time sets the pace until the next."""

    def __init__(self, every: int, start_step: int):
        self.every = every
        self.next = start_step + 1
        self._since = (start_step, time.monotonic())

    def due(self, step: int) -> bool:
        return step >= self.next

    def steps_to_next(self, step: int) -> int:
        """This rank's proposal at a check after `step`: the steps that take about STOP_CHECK_SECONDS at this
        clock's pace since the last check, 1 to --sync_check_every. The check carries rank 0's to every rank."""
        now = time.monotonic()
        (since, then), self._since = self._since, (step, now)
        per_step = (now - then) / max(1, step - since)
        return self.every if per_step <= 0 else max(1, min(self.every, int(STOP_CHECK_SECONDS / per_step)))

    def agreed(self, step: int, steps_to_next: int) -> None:
        """Rank 0's proposal at the check after `step`, as every rank got it: the next check's step."""
        self.next = min(step + steps_to_next, (step // self.every + 1) * self.every)


@dataclass
class SyncResult:
    stop_ranks: list  # ranks on which a stop was requested (a signal)
    out_of_time: bool  # rank 0's --max_minutes are up
    steps_in_time: int | None  # the steps rank 0's clock says fit in --max_minutes (None: no estimate)


def _differs(column: torch.Tensor, rtol: float = 0.0) -> list[int]:
    ref = column[0]
    tol = rtol * max(abs(float(ref)), 1.0)
    return [r for r in range(1, len(column)) if abs(float(column[r] - ref)) > tol]


def sync_check(ctx: DistContext, *, step: int, epoch: int, samples_seen: int, stop: bool, out_of_time: bool,
               steps_in_time: int | None, codebooks, checks: CheckSchedule) -> SyncResult:
    """The check after `step`; every rank calls it at the same step (`checks` says which, and learns the next)."""
    table = exchange(ctx, [step, epoch, samples_seen, int(stop), int(out_of_time),
                           -1 if steps_in_time is None else steps_in_time, checks.steps_to_next(step),
                           *codebook_checksum(codebooks)])
    col = {name: table[:, i] for i, name in enumerate(FIELDS)}
    for name in ("step", "epoch", "samples_seen"):
        bad = _differs(col[name])
        if bad:
            detail = ", ".join(f"rank {r} at {int(col[name][r])}" for r in bad)
            raise RanksDiverged(
                f"sync check at step {step}: ranks disagree on {name}: rank 0 at {int(col[name][0])}, {detail}")
    bad = sorted(set(_differs(col["codebook_sum"], CHECKSUM_RTOL)) | set(_differs(col["codebook_sq"], CHECKSUM_RTOL)))
    if bad:
        ranks = ", ".join(str(r) for r in bad)
        raise RanksDiverged(
            f"sync check at step {step}: the codebooks of rank(s) {ranks} differ from rank 0's "
            f"(checksums {[round(float(v), 6) for v in col['codebook_sum']]})")
    checks.agreed(step, int(col["steps_to_next"][0]))
    stop_ranks = [r for r in range(len(table)) if col["stop"][r] > 0]
    total = int(col["steps_in_time"][0])
    return SyncResult(stop_ranks, bool(col["out_of_time"][0] > 0), None if total < 0 else total)
