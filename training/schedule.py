"""How long a run trains and how far along its learning-rate schedule is.

The budget is steps (`--max_steps`, or `--epochs` of the plan's steps), time
(`--max_minutes`, counted from the process start: the k-means init before the
first step, the codebook refit and the final eval after the last are inside it),
or both, whichever ends first. With none of them the run trains for the larger of
DEFAULT_STEPS and one epoch: a few epochs of a small corpus are too few steps for
the codebooks, and one epoch of a large one is a sensible unit.

Under a time budget the schedule is steps too: the clock gives an estimate of the
steps that fit (`steps_in_time`), refreshed as the loop runs, and the learning rate
decays over the smaller of the two totals. On several ranks the estimate is rank
0's, carried by the sync check, so every rank computes the same learning rate at
every step. A resumed run starts its schedule where the checkpoint left it
(`fraction`) and decays the rest over its own budget. Under a time budget that is
what is left of --max_minutes: a checkpoint records the seconds its run spent
(`spent`; the whole budget once the clock ended the schedule), so a relaunch with
the same flags only finishes the end of the schedule, and a larger --max_minutes
trains on for the minutes added. It records the seconds a training frame took too
(`per_frame`), so that a relaunch with no step left reads in its refit the frames
the run it resumes would have read, not the whole --refit_frames.
"""
from __future__ import annotations

import logging
import math
import time
from enum import Enum

from training.config import DEFAULT_STEPS, OptimConfig

log = logging.getLogger(__name__)

# a schedule shorter than this gets a warning: too few updates, or too few frames per code per level
SHORT_STEPS = 500
SHORT_FRAMES_PER_CODE = 1000
# The end of the schedule (codebook refit, final eval, checkpoint) is estimated from the training steps' time per
# frame. Per frame and per code sequence of the beam, each of the refit's passes (its iterations and its last beam
# step) costs about REFIT_COST training frames, and the final eval, whose codes come from the library's beam
# search, about EVAL_COST (measured on 2 CPU cores, 8 x 1024 codes, beam 4: refit 20.5 s for 74k frames, eval
# 6.5 s for 7k, at 0.1 ms a training frame). Kept with a margin, plus a checkpoint's write. The estimate is high
# for a small codec, whose steps are mostly fixed overhead: at most END_SHARE of the budget. The refit itself reads
# at most the frames that fit in REFIT_SHARE of the budget at that cost, whatever the corpus: --refit_frames of a
# large corpus would otherwise take the time of the steps (benchmarks/README.md).
REFIT_COST = 0.25
EVAL_COST = 2.5
SAFETY = 1.5
SAVE_S = 5.0
END_SHARE = 0.25
REFIT_SHARE = 0.1


class ScheduleEnd(str, Enum):
    """Why a schedule ended: the stops that get the end-of-schedule work (the refit and the final eval), as the
    loop, the checkpoint and metrics.jsonl's stop event name them. A stop on request (a signal, non-finite steps)
    is a description of its own, not one of these."""

    MAX_STEPS = "max_steps"
    EPOCHS = "epochs"
    MAX_MINUTES = "max_minutes"
    SCHEDULE = "schedule"

    __str__ = str.__str__  # logs and JSON show the value


class Schedule:
    def __init__(self, optim: OptimConfig, *, steps_per_epoch: int, frames_per_step: int, world_size: int,
                 codebook_size: int, started_at: float, start_step: int = 0, start_fraction: float = 0.0,
                 time_spent: float = 0.0, per_frame: float | None = None):
        """frames_per_step: per rank (all micro-batches). started_at: the process start (time.monotonic()), which
        --max_minutes counts from. start_step, start_fraction, time_spent: where a resumed run's schedule was, and
        the seconds of --max_minutes its runs spent, which this run has no more. per_frame: the seconds a training
        frame took in the run resumed, until this run measures its own (`refit_frames`)."""
        self.optim = optim
        if optim.max_steps:
            self.steps, self.end, why = optim.max_steps, ScheduleEnd.MAX_STEPS, f"--max_steps {optim.max_steps}"
        elif optim.epochs:
            self.steps, self.end = optim.epochs * steps_per_epoch, ScheduleEnd.EPOCHS
            why = f"--epochs {optim.epochs} of {steps_per_epoch} steps"
        elif optim.max_minutes:
            self.steps, self.end, why = None, ScheduleEnd.MAX_MINUTES, f"--max_minutes {optim.max_minutes:g} alone"
        else:
            self.steps, self.end = max(DEFAULT_STEPS, steps_per_epoch), ScheduleEnd.SCHEDULE
            why = (f"no --max_steps, --epochs or --max_minutes: the larger of {DEFAULT_STEPS} steps and one epoch "
                   f"of {steps_per_epoch}")
        self.started_at, self.time_spent = started_at, time_spent
        self.deadline = None if optim.max_minutes is None else started_at + 60 * optim.max_minutes - time_spent
        self.ran_out = False  # the clock ended the schedule: the whole budget is spent (`spent`)
        self.start_step, self.start_fraction = start_step, start_fraction
        self.steps_in_time = None  # steps that fit in the time left, estimated from the clock
        self._warned = False
        self._origin = None  # (step, time) the step-time clock counts from: after the first step, which is slower
        self.end_work = 0.0  # estimated seconds for the refit, the final eval and the checkpoint
        self.per_frame = per_frame  # seconds a training frame takes on this rank, measured by `estimate`
        self.frames_per_step, self.world_size = frames_per_step, world_size
        self.why = why
        if self.steps is not None:
            frames_per_code = self.steps * frames_per_step * world_size / codebook_size
            if self.steps < SHORT_STEPS or frames_per_code < SHORT_FRAMES_PER_CODE:
                log.warning("the schedule is short for the codebooks: %d steps, %.0f frames per code per level (%s); "
                            "pass --max_minutes M to train for M minutes, or a larger --max_steps", self.steps,
                            frames_per_code, why)

    def check_setup(self, now: float | None = None) -> None:
        """Before the first step, under --max_minutes: warn when the set-up (imports, data checks, the k-means
        init, a compile) has already taken more than END_SHARE of the budget. The refit and the final eval are
        passes over the codebooks of the same order as the k-means init, so such a budget leaves little or no
        time to train, and the end work may overrun it; say what budget would fit."""
        if self.deadline is None:
            return
        now = time.monotonic() if now is None else now
        budget = self.deadline - self.started_at  # this run's: less what the runs it resumes spent
        setup = now - self.started_at
        if 0 < budget < setup / END_SHARE:
            log.warning("set-up took %.0f s, %.0f%% of --max_minutes %g%s, before the first step; the codebook refit "
                        "and the final eval take time of the same order, so little is left to train and the run "
                        "may end late: pass --max_minutes %d or more, or lower --kmeans_init_frames, "
                        "--refit_frames and --eval_frames", setup, 100 * setup / budget, self.optim.max_minutes,
                        f" (the {budget:.0f} s of it left to this resumed run)" if self.time_spent else "",
                        math.ceil((self.time_spent + setup / END_SHARE) / 60) + 1)

    def describe(self) -> str:
        parts = []
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.deadline is not None:
            parts.append(f"{self.optim.max_minutes:g} minutes from the start, refit and final eval included"
                         + (f", {self.time_spent:.0f} s of them spent before this resume" if self.time_spent else ""))
        return f"{' or '.join(parts)}, whichever ends first ({self.why})" if len(parts) > 1 else \
            f"{parts[0]} ({self.why})"

    @property
    def total(self) -> float:
        """The steps the learning rate decays over: the step budget, or what the clock says fits if fewer."""
        totals = [t for t in (self.steps, self.steps_in_time) if t is not None]
        return min(totals) if totals else math.inf

    def fraction(self, step: int) -> float:
        """How far along the decay the run is at `step`, from where a resumed run started."""
        warmup = self.optim.warmup_steps
        if self.deadline is None:  # steps alone: a function of the step, so a resumed run matches an unbroken one
            return min(1.0, max(0, step - warmup) / max(1, self.total - warmup))
        begin = max(self.start_step, warmup)
        if step <= begin:
            return self.start_fraction
        span = self.total - begin
        done = 1.0 if span <= 0 else min(1.0, (step - begin) / span)
        return self.start_fraction + (1 - self.start_fraction) * done

    def learning_rate(self, step: int) -> float:
        """Linear warmup, then cosine decay to lr x min_lr_ratio over the schedule."""
        o = self.optim
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        f = self.fraction(step)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * f)))

    def estimate(self, step: int, *, refit_frames: int, refit_iters: int, eval_frames: int, beam_size: int,
                 now: float | None = None) -> int | None:
        """The steps that fit before the deadline, keeping time for the end of the schedule (None: no deadline,
        or too early to tell). refit_frames: this rank's; eval_frames: over all ranks; beam_size: the codec's,
        which the refit fits for and the final eval encodes with. The trainer shares rank 0's answer and passes
        it to `set_steps_in_time`."""
        if self.deadline is None:
            return None
        now = time.monotonic() if now is None else now
        if self._origin is None:  # called after every step: the first call starts the clock
            self._origin = (step, now)
        if step - self._origin[0] < 2:
            return None
        per_step = (now - self._origin[1]) / (step - self._origin[0])
        self.per_frame = per_frame = per_step / self.frames_per_step
        refit_frames = self.refit_frames(refit_frames, refit_iters, beam_size)
        end_work = SAFETY * per_frame * beam_size * (REFIT_COST * (refit_iters + 1) * refit_frames
                                                     + EVAL_COST * eval_frames / self.world_size) + SAVE_S
        cap = END_SHARE * 60 * self.optim.max_minutes
        if end_work > cap and not self._warned:
            log.warning("the codebook refit and the final eval may take about %.0f s, more than a quarter of "
                        "--max_minutes: %.0f s are kept for them; lower --refit_frames or --eval_frames, or raise "
                        "--max_minutes", end_work, cap)
            self._warned = True
        self.end_work = min(end_work, cap)
        return step + max(0, int((self.deadline - self.end_work - now) / per_step))

    def refit_frames(self, frames: int, iters: int, beam_size: int) -> int:
        """The refit's frames on this rank: `frames`, or under a time budget at most what fits in REFIT_SHARE
        of it at the measured time per frame (REFIT_COST per pass and code sequence of the beam). Ranks may
        differ: the refit's k-means sums over all ranks whatever each one reads."""
        if self.deadline is None or self.per_frame is None or not iters:
            return frames
        per_refit_frame = self.per_frame * REFIT_COST * (iters + 1) * beam_size
        return min(frames, int(REFIT_SHARE * 60 * self.optim.max_minutes / per_refit_frame))

    def set_steps_in_time(self, total: int | None) -> None:
        if total is not None:
            self.steps_in_time = total

    def stop_reason(self, step: int) -> ScheduleEnd | None:
        """Why the schedule ends after `step` (the same on every rank), or None."""
        if self.steps is not None and step >= self.steps:
            return self.end
        if self.steps_in_time is not None and step >= self.steps_in_time:
            return ScheduleEnd.MAX_MINUTES
        if self.deadline is not None and self.deadline <= self.started_at:  # resumed with none of the budget left
            return ScheduleEnd.MAX_MINUTES
        return None

    def spent(self, now: float | None = None) -> float:
        """Seconds of the time budget spent, by this run and the runs it resumes (a checkpoint's "time_spent"):
        all of --max_minutes once the clock ended the schedule (`ran_out`), however early the end's work was done,
        so that a relaunch with the same flags trains no more and one with a larger budget trains the minutes
        added."""
        if self.ran_out:
            return max(self.time_spent, 60 * self.optim.max_minutes)
        now = time.monotonic() if now is None else now
        return self.time_spent + now - self.started_at

    def out_of_time(self, now: float | None = None) -> bool:
        """The hard stop: the deadline less the end of the schedule's work is past."""
        now = time.monotonic() if now is None else now
        return self.deadline is not None and now >= self.deadline - self.end_work
