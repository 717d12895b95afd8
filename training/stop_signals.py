"""The stop signals, and a record of those that arrive before a process's stop machinery is up.

The standard library only: an entry script imports it on its first lines, before torch and its own modules
(seconds a process, longer with eight ranks on a node), so that a stop signal in that time is recorded rather than
fatal (143, or -15 in torchrun's summary, and a restart under --max-restarts). The real handlers take over what was
recorded when they are installed (training/signals.py: StopRequest.install). Stop signals that arrive blocked (a
launcher that became this process by exec, with a stop pending: tools/launch.py) are delivered once the record is
in place.
"""
from __future__ import annotations

import os
import signal

from errors import EXIT_INTERRUPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)

_received: list[str] = []  # the names of the stop signals recorded so far, oldest first


def record_stops() -> None:
    """From now until other handlers replace these, a stop signal is recorded (a second SIGINT exits at once, 130)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _record(signum, _frame) -> None:
    if signum == signal.SIGINT and _received:
        os._exit(EXIT_INTERRUPTED)
    _received.append(signal.Signals(signum).name)


def take_recorded() -> list[str]:
    """The stop signals recorded since record_stops(), oldest first; the record is emptied."""
    names = _received[:]
    del _received[:]
    return names
