"""Fault injection for tests and drills, through one variable: RVQ_FAULT.

    RVQ_FAULT=kind[:key=value...][,kind...]

Each fault fires once, and only in the first attempt of an elastic job
(TORCHELASTIC_RESTART_COUNT 0 or unset), so that a restarted job runs clean;
rank defaults to every rank, step to the first chance:
    kill:rank=1:step=30          SIGKILL this rank at step 30 (a lost rank)
    hang:rank=1:step=30[:at=backward]  SIGSTOP this rank at step 30 (stopped, not dead); at=backward
                                 stops it after the forward pass, so peers block in the gradient all-reduce
    nan:step=12[:rank=0]         make the loss NaN at step 12
    desync:rank=1:step=20        perturb this rank's first codebook (and its EMA state) at step 20
    eval_error:rank=1[:step=S]   raise inside evaluation
    signal:rank=0:step=10[:sig=TERM]  send this rank a signal at step 10 (TERM, INT or USR1)
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from errors import BadInputError

KINDS = ("kill", "hang", "nan", "desync", "eval_error", "signal")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    sig: str = "TERM"
    at: str = "step"  # "step": before the step; "backward": between the forward and backward passes

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
            if key in ("rank", "step") and value.isdigit():
                fields[key] = int(value)
            elif key == "sig" and value in ("TERM", "INT", "USR1"):
                fields[key] = value
            elif key == "at" and value in ("step", "backward"):
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

    def _take(self, kind: str, step: int, at: str = "step") -> Fault | None:
        """The fault of this kind due now, once: at its step, or at the first chance when it names none."""
        for fault in self.faults:
            if (fault.kind == kind and fault.at == at and fault not in self._fired
                    and fault.applies(self.rank, step)):
                self._fired.add(fault)
                return fault
        return None

    def before_step(self, step: int, model) -> None:
        if self._take("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("hang", step):
            os.kill(os.getpid(), signal.SIGSTOP)
        fault = self._take("signal", step)
        if fault:
            os.kill(os.getpid(), getattr(signal, f"SIG{fault.sig}"))
        if self._take("desync", step):
            codebook = model.rvq.layers[0]._codebook
            with torch.no_grad():  # the library recomputes embed from embed_avg: scale both
                codebook.embed_avg.mul_(1.01)
                codebook.embed.mul_(1.01)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Called between the forward and the backward pass."""
        if self._take("hang", step, at="backward"):
            os.kill(os.getpid(), signal.SIGSTOP)
        return loss * float("nan") if self._take("nan", step) else loss

    def in_eval(self, step: int) -> None:
        if self._take("eval_error", step):
            raise RuntimeError(f"injected eval error on rank {self.rank} at step {step}")
