"""Fault injection for tests and drills, through one variable: RVQ_FAULT.

    RVQ_FAULT=kind[:key=value...][,kind...]

Each fault fires once (slow_steps at every step), and only in the first
attempt of an elastic job (TORCHELASTIC_RESTART_COUNT 0 or unset), so that a
restarted job runs clean; rank defaults to every rank, step to the first chance:
    kill:rank=1:step=30[:sig=ABRT]  SIGKILL this rank at step 30 (a lost rank); sig=ABRT: SIGABRT, as
                                 NCCL's watchdog aborts a rank whose collective timed out; sig=SEGV: SIGSEGV,
                                 as a crash in native code ends a process; in tools.encode,
                                 tools.extract and tools.tokenize, the --rank 1 process once it has written
                                 chunk 30 of its shard, before committing it
    hang:rank=1:step=30[:at=backward]  SIGSTOP this rank at step 30 (stopped, not dead); at=backward
                                 stops it after the forward pass, so peers block in the gradient all-reduce; in
                                 the tools, as kill does
    nan:step=12[:rank=0]         make the loss NaN at step 12
    desync:rank=1:step=20        perturb this rank's first codebook (and its EMA state) at step 20
    eval_error:rank=1[:step=S]   raise inside evaluation
    signal:rank=0:step=10[:sig=TERM]  send this rank a signal at step 10 (TERM, INT, USR1 or HUP)
    stall:rank=1:step=30[:seconds=N][:at=PHASE]  this rank's main thread sleeps (N s, or for good) as it enters
                                 PHASE (default data) at step 30; its other threads and the process live on
    extra_collective:rank=1:step=30  this rank enters an all-reduce the others never join, at step 30
    slow_save:seconds=N[:step=S]   rank 0's checkpoint write takes N s longer
    slow_steps:seconds=N[:rank=R][:step=S]  every step from step S on takes N s longer on this rank (default 1 s;
                                 not once: a slow machine)
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from errors import BadInputError
from training.progress import PHASES

KINDS = ("kill", "hang", "nan", "desync", "eval_error", "signal", "stall", "extra_collective", "slow_save",
         "slow_steps")
STALL_PHASES = tuple(PHASES)
KILL_SIGNALS = ("ABRT", "SEGV")  # kill's sig=: raised on the calling thread (default: SIGKILL)
SIGNAL_SIGNALS = ("TERM", "INT", "USR1", "HUP")  # signal's sig=
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    sig: str = "TERM"
    at: str = "step"  # "step": before the step; "backward": between the forward and backward passes; a phase
    seconds: int | None = None  # stall, slow_save, slow_steps: how long (a stall without it lasts for good)

    def applies(self, rank: int, step: int) -> bool:
        return (self.rank is None or self.rank == rank) and (self.step is None or self.step == step)


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise BadInputError(f"RVQ_FAULT: unknown fault {kind!r}; one of {', '.join(KINDS)}")
        fields = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key in ("rank", "step", "seconds") and value.isdigit():
                fields[key] = int(value)
            elif key == "sig" and value in (KILL_SIGNALS if kind == "kill" else SIGNAL_SIGNALS):
                fields[key] = value
            elif key == "at" and value in ("step", "backward") + (STALL_PHASES if kind == "stall" else ()):
                fields[key] = value
            else:
                raise BadInputError(f"RVQ_FAULT: cannot read {pair!r} in {item!r}")
        faults.append(Fault(kind, **fields))
    return faults


class FaultInjector:
    """Hooks the loop calls; each does nothing unless RVQ_FAULT names it."""

    def __init__(self, rank: int, text: str | None = None):
        self.rank = rank
        self.faults = parse_faults(os.environ.get("RVQ_FAULT") if text is None else text)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            self.faults = []
        self._fired: set = set()
        self._extra_group = None

    def _take(self, kind: str, step: int, at: str = "step") -> Fault | None:
        """The fault of this kind due now, once: at its step, or at the first chance when it names none."""
        for fault in self.faults:
            if (fault.kind == kind and fault.at == at and fault not in self._fired
                    and fault.applies(self.rank, step)):
                self._fired.add(fault)
                return fault
        return None

    def before_step(self, step: int, model) -> None:
        for fault in self.faults:
            if fault.kind == "slow_steps" and (fault.rank is None or fault.rank == self.rank) and \
                    step >= (fault.step or 0):
                time.sleep(1 if fault.seconds is None else fault.seconds)
        fault = self._take("kill", step)
        if fault:
            kill_this_process(fault)
        if self._take("hang", step):
            stop_this_process()
        fault = self._take("signal", step)
        if fault:
            os.kill(os.getpid(), getattr(signal, f"SIG{fault.sig}"))
        if self._take("desync", step):
            model.scale_codebook_(0, 1.01)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Called between the forward and the backward pass."""
        if self._take("hang", step, at="backward"):
            stop_this_process()
        return loss * float("nan") if self._take("nan", step) else loss

    def in_eval(self, step: int) -> None:
        if self._take("eval_error", step):
            raise RuntimeError(f"injected eval error on rank {self.rank} at step {step}")

    def on_phase(self, step: int, phase: str) -> None:
        """Called as the main thread enters a phase (Progress.on_enter)."""
        for fault in self.faults:
            if fault.kind == "stall" and phase == (fault.at if fault.at in STALL_PHASES else "data"):
                if fault not in self._fired and fault.applies(self.rank, step):
                    self._fired.add(fault)
                    log.warning("RVQ_FAULT: rank %d's main thread stalls in %s at step %d for %s", self.rank, phase,
                                step, f"{fault.seconds}s" if fault.seconds is not None else "good")
                    stall(fault.seconds)
        if phase == "data" and self._extra_group is None and any(f.kind == "extra_collective" for f in self.faults):
            # a group of its own, made by every rank: on the main group the others' next collective would pair
            # with it, and gloo would abort on the size mismatch instead of hanging as NCCL does
            self._extra_group = dist.new_group(backend="gloo")
        if phase == "data" and self._take("extra_collective", step):
            log.warning("RVQ_FAULT: rank %d enters an all-reduce the other ranks never join, at step %d",
                        self.rank, step)
            dist.all_reduce(torch.zeros(3), group=self._extra_group)

    def before_commit(self, step: int) -> None:
        """Called by tools.encode, tools.extract and tools.tokenize between writing chunk `step` (from 1) of their
        shard and committing it."""
        fault = self._take("kill", step)
        if fault:
            kill_this_process(fault)
        if self._take("hang", step):
            stop_this_process()

    def before_write(self, step: int) -> None:
        """Called on rank 0 as it starts writing a checkpoint."""
        fault = self._take("slow_save", step)
        if fault and fault.seconds:
            log.warning("RVQ_FAULT: this checkpoint write takes %ds longer", fault.seconds)
            time.sleep(fault.seconds)


def kill_this_process(fault: Fault) -> None:
    """SIGKILL this process; or the signal the fault names (ABRT, SEGV), raised on the calling thread as abort()
    and a crash in native code raise theirs, so that the fatal-signal handler runs there and names it current."""
    if fault.sig in KILL_SIGNALS:
        signal.pthread_kill(threading.get_ident(), getattr(signal, f"SIG{fault.sig}"))
    os.kill(os.getpid(), signal.SIGKILL)


def stop_this_process() -> None:
    """SIGSTOP this process before the calling thread goes on. A stop sent to the process is taken by one of its
    threads (the kernel picks the main thread first), and the thread that sent it runs on until that one has
    stopped the others: a writer thread would commit the chunk it was stopped before. Sent to the calling thread,
    it stops that thread on its way back from the call, and with it every other."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def stall(seconds: int | None) -> None:
    """Sleep in the calling thread: N seconds, or for good."""
    end = time.monotonic() + seconds if seconds is not None else float("inf")
    while time.monotonic() < end:
        time.sleep(min(1.0, end - time.monotonic()))
