"""Stop requests from signals: SIGTERM, SIGINT, SIGUSR1 and SIGHUP set a flag the run reads.

The loop stops at a step boundary, on every rank at the same step (agreed at
the next sync check), and writes a checkpoint. The slow phases (k-means init,
refit, eval) look at the flag between chunks of their work (`Chunks`, below),
so that a stop is honoured there within seconds too; where those chunks hold
collectives the look is agreed by every rank (`agree_to_stop`) and every rank
raises `Stopped` at the same point. An eval holds no collective until its end:
there each rank looks at its own flag (`agreed=False`), and the eval's one
exchange carries a stop to the others (training/evaluate.py). Between two such
points a rank also heeds a stop requested on a peer, as its watchdog last read
the peers' published states (`StopRequest.anywhere`): a rank that got no signal
cuts its pass short within a heartbeat, rather than finish it while the
signalled rank waits. Once the run's outcome is saved (`settle`),
a signal changes nothing, up to the process's exit (`restore(ignore=True)`), so
a late SIGTERM cannot turn a clean exit into 143. A second SIGINT exits at once
(with the settled exit code, once there is one).

A stop signal during the process's start-up, before these handlers are installed, is recorded from the entry
script's first lines (training/stop_signals.py, the standard library only, before torch is imported) and taken
over when they are (`install`): the run stops before its first step, agreed by every rank, with nothing to save.

Some work has nothing to save and may take longer than a scheduler's grace period:
a compile of the training step (the trained state is saved before it), and the
k-means init before the first step, whose library passes over the whole sample
cannot be cut into chunks from outside. While the trainer says such work may be
abandoned (`abandoning`), a stop signal raises `Interrupted` where the main thread
is, as Ctrl-C would, rather than wait for the work's end; an error that the abandoned
code raises while unwinding from it (a compiler's own clean-up) is that stop too. Where the handler ran inside a
finalizer (a weakref callback, a `__del__`), which cannot raise, Python reports the Interrupted as unraisable and
goes on: the stop is then delivered to the main thread again (`_unraisable`) and raised outside it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time

from tqdm import tqdm

from errors import EXIT_INTERRUPTED
from training.distributed import DistContext, exchange
from training.stop_signals import STOP_SIGNALS, take_recorded

log = logging.getLogger(__name__)


class Stopped(Exception):
    """A stop agreed inside a slow phase: its work is abandoned on every rank alike. The text is the stop reason."""


class Interrupted(BaseException):
    """A stop signal during work that may be abandoned (StopRequest.abandoning: a compile, the k-means init). Not an
    Exception, so that the compiler's and libraries' own handlers let it through, as they do KeyboardInterrupt. The
    text is the signal's name."""


class StopRequest:
    def __init__(self):
        self.reason: str | None = None
        self.settled: int | None = None  # the exit code, once the run's outcome is saved
        self.interrupt: str | None = None  # the work a stop signal now abandons, raising Interrupted (abandoning)
        self.peer: int | None = None  # a peer rank whose stop request the watchdog saw published (training/watchdog.py)
        self.abandoned: tuple[str, int] | None = None  # the work and signal an Interrupted was raised for
        self.redelivered = False  # the next stop signal is this object's own delivery again (_unraisable)
        self.reporting = False  # inside Python's report of an unraisable exception (_unraisable)
        self._previous = {}

    def __bool__(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def seen_on(self, peer: int) -> None:
        """The watchdog read `peer`'s published state: a stop is requested there (from the watchdog's thread)."""
        if self.peer is None:
            self.peer = peer

    def anywhere(self) -> bool:
        """A stop is requested on this rank or, as far as the watchdog has read, on a peer: work between two
        agreed points may end early on it, and the next agreement raises on every rank (agree_to_stop)."""
        return self.reason is not None or self.peer is not None

    def settle(self, exit_code: int) -> None:
        """The run's outcome is saved (its last checkpoint written, or none due): later signals change nothing."""
        self.settled = exit_code

    def install(self) -> "StopRequest":
        """The stop signals set the flag from now on; one recorded since the process's first line (the entry
        script's training.stop_signals.record_stops, before its imports) is taken over: the run stops before its
        first step (Trainer.stop_before_the_first_step)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            for name in take_recorded():
                self.request(name)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.redelivered:  # a stop a finalizer swallowed, delivered again: raised unless the work is over
            if self.reporting:  # still inside the report of the swallowed one, which cannot raise either
                self._redeliver(signum)
                return
            self.redelivered = False
            if self.interrupt:
                self.interrupt = None
                raise Interrupted(name)
            return
        second = self.reason is not None
        self.request(name)
        if self.settled is not None:
            if signum == signal.SIGINT and second:
                os._exit(self.settled)
            log.warning("%s received after the run's outcome was saved: it ends as it would have (exit code %d)",
                        name, self.settled)
            return
        if signum == signal.SIGINT and second:
            log.error("second SIGINT: exiting now, without a checkpoint")
            os._exit(EXIT_INTERRUPTED)
        if self.interrupt:
            work, self.interrupt = self.interrupt, None
            self.abandoned = (work, signum)
            log.warning("%s received during %s: it is abandoned", name, work)
            raise Interrupted(name)
        log.warning("%s received: stopping at the next point all ranks agree on (a step boundary, or between two "
                    "chunks of the k-means init, the refit or an eval), with a checkpoint", name)

    @contextlib.contextmanager
    def abandoning(self, work: str):
        """While the block runs, a stop signal raises Interrupted at once where the main thread is: `work` (the
        compile, the k-means init) has nothing to save and is abandoned. A stop requested before the block raises
        it at once."""
        if self:
            raise Interrupted(self.reason)
        self.interrupt, hook = work, sys.unraisablehook
        sys.unraisablehook = functools.partial(self._unraisable, hook)
        try:
            yield
        except Interrupted:
            raise
        except BaseException as error:
            if (interrupted := raised_while_interrupted(error)) is None:
                raise
            # the code the signal broke out of failed in its own clean-up (dynamo's tracer, popping a frame it
            # had not pushed): the signal's stop, not that error, is what happened
            log.warning("%s, while abandoning %s: %s: %s", interrupted, work, type(error).__name__, error)
            raise Interrupted(str(interrupted)) from error
        finally:
            self.interrupt, self.abandoned = None, None
            sys.unraisablehook = hook

    def _unraisable(self, hook, unraisable) -> None:
        """Python's report of an exception it could not raise (sys.unraisablehook, while `abandoning`). The
        Interrupted of a handler that ran inside a finalizer is one: the signal is delivered to the main thread
        again, from another thread, and its handler raises it outside the finalizer. Any other goes to `hook`."""
        if not isinstance(unraisable.exc_value, Interrupted) or self.abandoned is None:
            return hook(unraisable)
        work, signum = self.abandoned
        self.interrupt, self.redelivered, self.reporting = work, True, True
        try:
            self._redeliver(signum)
        finally:
            self.reporting = False

    def _redeliver(self, signum: int) -> None:
        """`signum` to the main thread, shortly, from a thread of its own (sent from the main thread, its handler
        would run at once, still inside the report); not once the abandoned work is over, when nothing is left to
        raise in and the handler may be another's (restore)."""
        main = threading.main_thread().ident

        def send():
            time.sleep(0.01)
            if self.abandoned is None:
                self.redelivered = False
            else:
                signal.pthread_kill(main, signum)

        threading.Thread(target=send, name="stop-redelivery", daemon=True).start()

    def restore(self, ignore: bool = False) -> None:
        """Put the previous handlers back; or, with ignore (the process ends with the run), ignore the stop
        signals from now on: the interpreter's exit resets handlers written in Python to the default, where a
        late SIGTERM would end the process with 143, but leaves an ignore alone."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else handler)
        self._previous.clear()


def raised_while_interrupted(error: BaseException) -> Interrupted | None:
    """The Interrupted that `error` was raised while handling (its __context__ chain), None when there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Interrupted):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def agree_to_stop(ctx: DistContext, stop: StopRequest) -> str | None:
    """The stop reason when a stop was requested on any rank, else None; every rank calls it at the same point
    (one exchange over the control plane) and gets the same answer."""
    if not ctx.is_distributed:
        return stop_reason(ctx, stop, [])
    return stop_reason(ctx, stop, [r for r, flag in enumerate(exchange(ctx, [bool(stop)])[:, 0]) if flag > 0])


def stop_reason(ctx: DistContext, stop: StopRequest, ranks: list[int]) -> str | None:
    """The reason of a stop requested on `ranks` (one process: its own signal), as the `stop` event gives it;
    None when there is none."""
    if not ctx.is_distributed:
        return f"signal {stop.reason}" if stop else None
    return f"signal on rank(s) {ranks}" if ranks else None


class Chunks:
    """`chunks()` between two chunks of a slow phase's work (the k-means init, the refit, the evals): a bar on
    rank 0 moves on, and a stop requested raises Stopped."""

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
