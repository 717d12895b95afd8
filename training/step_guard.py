"""Whether an optimizer step is applied, skipped as a bad step, or skipped as an fp16 scaler overflow.

Under fp16 the GradScaler starts at a large scale (2**16) and halves it whenever the scaled
gradients overflow: a non-finite gradient is then the scaler finding its scale, not a fault, and
does not count toward --max_bad_steps. Without a scaler (fp32, bf16), or once the scale has fallen
below MIN_SCALE (no overflow of fp16 is left to explain it), a non-finite gradient is a bad step.

The decision uses only what is the same on every rank (the all-reduced gradient's norm and the
scale, which every rank updates alike), so that every rank counts the same bad steps with no
collective; a rank's own loss is not (a non-finite loss shows as a non-finite gradient anyway).
It reads one flag from the device: the trainer's one host synchronisation per step, kept because
a skip must be known before the optimizer runs and the bad-step count is host state.
"""
from __future__ import annotations

import enum

import torch

# below this scale fp16 gradients no longer overflow from the scaling: the loss itself is broken
MIN_SCALE = 1.0


class StepOutcome(enum.Enum):
    APPLIED = "applied"
    SCALER_OVERFLOW = "scaler overflow"  # fp16: the scaler skipped the step and lowers its scale
    BAD = "bad"  # non-finite gradient without a scaler, or with a scale already below MIN_SCALE


def guarded_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                 grad_norm: torch.Tensor) -> StepOutcome:
    """Steps `optimizer` through `scaler` (after `scaler.unscale_`) when the gradient norm is finite,
    then updates the scaler."""
    if bool(torch.isfinite(grad_norm)):
        scaler.step(optimizer)
        outcome = StepOutcome.APPLIED
    elif scaler.is_enabled() and scaler.get_scale() >= MIN_SCALE:
        outcome = StepOutcome.SCALER_OVERFLOW
    else:
        outcome = StepOutcome.BAD
    scaler.update()
    return outcome
