"""Where the training loop is: its step, counters and current phase, in one small object.

The loop updates it; checkpoints, sync checks and log lines read it, and so does
the watchdog thread, which publishes the phase and how long the main thread has
been in it, and names the step and phase a rank was in when it stopped.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

# Every phase the main thread enters, and whether it may legitimately take long: a slow phase (and every phase of
# the first step, which may run the k-means init) gets --slow_phase_timeout, from the watchdog and from the
# process groups (Progress applies it as the phase starts), every other phase --sync_timeout.
PHASES = {"setup": True, "k-means init": True, "compile": True, "data": False, "forward": False, "backward": False,
          "optimizer": False, "train": False, "sync check": False, "refit": True, "eval": True, "checkpoint": True,
          "teardown": True}
# Within a step (counted as step + 1, the step being done), in the order the main thread enters them ...
IN_STEP = ("data", "forward", "backward", "optimizer")
# ... then after the step's count went up.
AFTER_STEP = ("train", "sync check", "refit", "eval", "checkpoint", "teardown")
FAILED = "failed"  # the main thread raised on one of several ranks and waits for the watchdog's verdict
STOPPED = "stopped on request"  # the rank left at once on a stop with nothing to save: its peers stop too, exit 0
END_OF_SCHEDULE = ("refit", "final eval")  # the work after the last step, in order


def is_slow(phase: str, step: int) -> bool:
    """Whether `phase` at `step` (steps done) gets the slow-phase allowance (PHASES; the first step's every phase)."""
    return PHASES.get(phase, False) or step == 0


def order(step: int, phase: str) -> tuple:
    """How far a rank has come: a rank with a smaller value is one the others wait for."""
    if phase in IN_STEP:
        return step + 1, IN_STEP.index(phase)
    if phase in AFTER_STEP:
        return step, len(IN_STEP) + AFTER_STEP.index(phase)
    return step, -1  # setup, k-means init: before the first step of this run; compile: a step's forward, compiling


@dataclass
class Progress:
    step: int = 0  # steps done
    samples_seen: int = 0  # crops trained on by this rank
    bad_steps: int = 0  # non-finite steps skipped so far
    bad_in_a_row: int = 0
    schedule_fraction: float = 0.0  # how far along the learning-rate decay (saved, for a resumed time budget)
    time_spent: float = 0.0  # seconds of --max_minutes spent by the run and those it resumed (saved: Schedule.spent)
    # seconds a training frame took on rank 0 under --max_minutes (saved: a resumed run with no step left sizes its
    # refit by it, as the run it resumes did: Schedule.per_frame)
    seconds_per_frame: float | None = None
    # END_OF_SCHEDULE's parts done after this step (saved as the checkpoint's "end_of_schedule": a resume at the end
    # of the schedule does the rest)
    end_of_schedule: list = field(default_factory=list)
    phase: str = "setup"  # what the main thread is doing: setup, data, forward, backward, eval, checkpoint ...
    stop_reason: str | None = None  # set when the loop is to end after this step
    since: float = field(default_factory=time.monotonic)  # when the main thread entered `phase`
    on_enter: list = field(default_factory=list)  # callables(step, phase) run as a phase starts (fault injection)
    raised_in: str | None = None  # the innermost phase an exception left (a failure's report names it)
    # slow_timeout(): a context manager giving the process groups the slow-phase timeout (the trainer sets it;
    # none: nothing to raise), entered by phase_of for a slow phase (is_slow), once however phases nest
    slow_timeout: object = None
    _in_slow: bool = False

    def __setattr__(self, name, value):
        if name == "phase":  # every phase change restarts the phase's clock, however it is made
            object.__setattr__(self, "since", time.monotonic())
        object.__setattr__(self, name, value)

    def enter(self, name: str) -> None:
        """Mark the main thread as inside `name` from now on."""
        self.phase = name
        for hook in self.on_enter:
            hook(self.step, name)

    @contextlib.contextmanager
    def phase_of(self, name: str):
        """Mark the main thread as inside `name` until the block ends."""
        outer = self.phase
        slow = self.slow_timeout is not None and not self._in_slow and is_slow(name, self.step)
        with self.slow_timeout() if slow else contextlib.nullcontext():
            self._in_slow = self._in_slow or slow
            self.enter(name)
            try:
                yield
            except BaseException:
                self.raised_in = self.raised_in or name
                raise
            finally:
                self.phase = outer
                if slow:
                    self._in_slow = False

    def __str__(self) -> str:
        return f"{self.step} ({self.phase})"
