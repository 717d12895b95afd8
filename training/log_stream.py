"""Log lines and progress bars on one stream (stderr), for the trainer and every tool, so that no log line is
glued to a bar's, on a terminal or in a file stderr is redirected to: each line is written with the bars drawn
on its stream cleared first and drawn again after (`write_line`).

tqdm.write does the same, but passes over a bar that is drawn and not yet fully made (tqdm sets the start time
its write looks for after the first draw): a stop signal's log line written at that moment was glued to the
bar. Here every bar that can have been drawn is cleared. A log line written by a signal handler while its
thread is inside another line's write waits for that write to end (BarAwareHandler)."""
from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import threading
from typing import TextIO

from tqdm import tqdm


def _same_stream(bar_stream, stream: TextIO) -> bool:
    """tqdm's own rule: the same stream, or stdout and stderr (a terminal shows both)."""
    return bar_stream == stream or all(s in (sys.stdout, sys.stderr) for s in (bar_stream, stream))


def write_line(text: str, stream: TextIO, end: str = "\n") -> None:
    """`text` + `end` on `stream`, each bar drawn there cleared before and drawn again after."""
    with tqdm.get_lock():
        # a bar has its printer (`sp`) before it is first drawn; one closed is no longer among the instances
        bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if getattr(bar, "sp", None) is not None
                and not bar.disable and _same_stream(bar.fp, stream)]
        for bar in bars:
            bar.clear(nolock=True)
        stream.write(text + end)
        stream.flush()
        for bar in bars:
            bar.refresh(nolock=True)


class BarAwareHandler(logging.StreamHandler):
    """A StreamHandler whose lines are written with `write_line`. A record emitted while this handler is already
    writing one can only come from a signal handler on the writing thread (logging's lock keeps other threads
    out): it is written once that write ends, not inside it."""

    def __init__(self, stream: TextIO):
        super().__init__(stream)
        self._writing = False
        self._waiting: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self._writing:
            self._waiting.append(record)
            return
        self._writing = True
        try:
            self._write(record)
            while self._waiting:
                self._write(self._waiting.pop(0))
        finally:
            self._writing = False

    def _write(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a record that cannot be written is reported, no more
            self.handleError(record)


def log_to_stderr(tag: str, level: int = logging.INFO) -> None:
    """Log lines as `HH:MM:SS [tag] LEVEL message` on stderr, beside any progress bar there."""
    logging.basicConfig(level=level, format=f"%(asctime)s [{tag}] %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[BarAwareHandler(sys.stderr)], force=True)


def report_crashes() -> None:
    """A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes every thread's Python stack to
    stderr before the process dies, so that the log says where each thread was; the exit code stays the signal's.
    For a process that ends with its command (the trainer's script, a tool's `python -m`), not for a caller's."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


def end_process(code: int) -> None:
    """End the process with `code` as the interpreter's own exit does (its threads that are not daemons waited for,
    its atexit functions run, its streams flushed), without the interpreter's finalization after that: there the
    bindings of compiled libraries report what they never freed (Triton's nanobind: 30-40 lines of `leaked function`
    under a run's last line, the one that says what to do next). For a process that ends with its command."""
    threading._shutdown()  # what the interpreter's exit does first, before atexit (CPython's own, since 3.x)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)


def exit_now(code: int) -> None:
    """End the process at once with `code` (os._exit: no unwinding, for a main thread that may be blocked in a
    collective), every log line written first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)
