"""Stop requests from signals: SIGTERM, SIGINT and SIGUSR1 set a flag the loop reads.

The loop stops at a step boundary, on every rank at the same step (agreed at
the next sync check), and writes a checkpoint. A second SIGINT exits at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    def __init__(self):
        self.reason: str | None = None
        self._previous = {}

    def __bool__(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.reason is not None:
            log.error("second SIGINT: exiting now, without a checkpoint")
            os._exit(130)
        log.warning("%s received: stopping at the next step boundary all ranks agree on, with a checkpoint", name)
        self.request(name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
