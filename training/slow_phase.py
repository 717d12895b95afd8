"""A slow phase's work in chunks (the k-means init, the refit, the evals): a bar on rank 0, and between two
chunks a look at the stop request, so that a signal is honoured within seconds in these phases too.

Where the chunks hold collectives (the k-means init, the refit), every rank looks at the same points and the
look is agreed over the control plane (training/signals.py, `agree_to_stop`): every rank raises Stopped
together, and none is left alone in a collective. An eval holds no collective until its end: there each rank
looks at its own flag (`agreed=False`), and the eval's one exchange carries a stop to the others
(training/evaluate.py). Between two such points a rank also heeds a stop requested on a peer, as its watchdog
last read the peers' published states (`StopRequest.anywhere`): a rank that got no signal cuts its pass short
within a heartbeat or two, rather than finish it while the signalled rank waits.
"""
from __future__ import annotations

from tqdm import tqdm

from training.distributed import DistContext
from training.signals import Stopped, StopRequest, agree_to_stop


class Chunks:
    """`chunks()` between two chunks of work: the bar moves on, and a stop requested raises Stopped."""

    def __init__(self, what: str, *, total: int, unit: str, ctx: DistContext, stop: StopRequest,
                 agreed: bool = True, show: bool = True):
        self.ctx, self.stop, self.agreed = ctx, stop, agreed
        self.bar = tqdm(total=total, desc=what, unit=unit, disable=ctx.rank != 0 or not show, dynamic_ncols=True,
                        mininterval=1.0, leave=False)

    def __call__(self) -> None:
        """Before each chunk, on every rank alike."""
        if self.agreed:
            reason = agree_to_stop(self.ctx, self.stop)
        else:  # this rank's own request, or a peer's the watchdog has read: the caller's exchange says whose
            reason = self.stop.reason or (f"a stop on rank {self.stop.peer}" if self.stop.anywhere() else None)
        if reason:
            raise Stopped(reason)
        self.bar.update(1)

    def requested(self) -> bool:
        """A stop requested on this rank, or on a peer as the watchdog last read, with no exchange: work between
        two calls may end early on it (then the next call raises on every rank, the requests agreed)."""
        return self.stop.anywhere()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Chunks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
