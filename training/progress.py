"""Where the training loop is: its step, counters and current phase, in one small object.

The loop updates it; checkpoints, sync checks and log lines read it, and so does
the watchdog thread, which names the step and phase a rank was in when it stopped.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass
class Progress:
    step: int = 0  # steps done
    samples_seen: int = 0  # crops trained on by this rank
    bad_steps: int = 0  # non-finite steps skipped so far
    bad_in_a_row: int = 0
    phase: str = "setup"  # what the main thread is doing: setup, train, eval, refit, checkpoint, teardown ...
    stop_reason: str | None = None  # set when the loop is to end after this step

    @contextlib.contextmanager
    def phase_of(self, name: str):
        """Mark the main thread as inside `name` until the block ends."""
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    def __str__(self) -> str:
        return f"{self.step} ({self.phase})"
