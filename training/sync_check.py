"""Sync checks over the control plane: ranks compare where they are and what they hold.

Every `--sync_check_every` steps each rank contributes its step, epoch,
samples seen, stop request, whether its --max_minutes are up, the steps its
clock says fit in them, and a checksum of its codebooks; a mismatch ends every
rank with RanksDiverged (exit 3) naming the rank(s) and step. A stop requested
on any rank (a signal) becomes a stop on all of them; rank 0's clock decides
--max_minutes, and the schedule's length under them, for every rank. One
exchange carries every reason to stop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from training.distributed import DistContext, exchange
from errors import RanksDiverged

FIELDS = ("step", "epoch", "samples_seen", "stop", "out_of_time", "steps_in_time", "codebook_sum", "codebook_sq")
CHECKSUM_RTOL = 1e-6


def codebook_checksum(codebooks) -> tuple[float, float]:
    """Two numbers that change when any codebook entry changes."""
    total, squares = 0.0, 0.0
    for level, embed in enumerate(codebooks):
        e = embed.detach().double()
        weights = torch.arange(1, e.shape[0] + 1, dtype=torch.float64, device=e.device)[:, None]
        total += float((e * weights).sum()) * (level + 1)
        squares += float((e * e).sum())
    return total, squares


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
               steps_in_time: int | None, codebooks) -> SyncResult:
    table = exchange(ctx, [step, epoch, samples_seen, int(stop), int(out_of_time),
                           -1 if steps_in_time is None else steps_in_time, *codebook_checksum(codebooks)])
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
    stop_ranks = [r for r in range(len(table)) if col["stop"][r] > 0]
    total = int(col["steps_in_time"][0])
    return SyncResult(stop_ranks, bool(col["out_of_time"][0] > 0), None if total < 0 else total)
