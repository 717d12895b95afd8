"""Log lines and progress bars on one stream (stderr), for the trainer and every tool: each record is written
through tqdm.write, which clears a bar drawn on the stream first and redraws it after, so that no log line is
glued to a bar's, on a terminal or in a file stderr is redirected to."""
from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm


class BarAwareHandler(logging.StreamHandler):
    """A StreamHandler that writes each record through tqdm.write."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a record that cannot be written is reported, no more
            self.handleError(record)


def log_to_stderr(tag: str, level: int = logging.INFO) -> None:
    """Log lines as `HH:MM:SS [tag] LEVEL message` on stderr, beside any progress bar there."""
    logging.basicConfig(level=level, format=f"%(asctime)s [{tag}] %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[BarAwareHandler(sys.stderr)], force=True)


def exit_now(code: int) -> None:
    """End the process at once with `code` (os._exit: no unwinding, for a main thread that may be blocked in a
    collective), every log line written first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)
