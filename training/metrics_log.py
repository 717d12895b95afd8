"""metrics.jsonl: one JSON object per event, written by rank 0 only; optionally TensorBoard scalars too.

With `tensorboard_dir`, every numeric field of an event is also written as the
scalar `event/field` at the event's step (a list, one number per level, as
`event/field/level_i`). That needs the `tensorboard` package.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from errors import BadInputError


def require_tensorboard():
    """torch's SummaryWriter class, or BadInputError when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise BadInputError("--tensorboard needs the tensorboard package: "
                            "pip install -r requirements-report.txt") from None
    return SummaryWriter


class MetricsLog:
    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None):
        writer = require_tensorboard() if tensorboard_dir is not None else None  # fails before any file is opened
        self._file = open(path, "a", buffering=1) if path is not None else None
        self._tb = writer(log_dir=str(tensorboard_dir)) if writer is not None else None

    def write(self, event: str, step: int, **fields) -> None:
        if self._file is not None:
            record = {"event": event, "step": int(step), "time": round(time.time(), 3)}
            for key, value in fields.items():
                record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
            self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in fields.items():
                if _is_number(value):
                    self._tb.add_scalar(f"{event}/{key}", value, int(step))
                elif isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
                    for level, v in enumerate(value):
                        self._tb.add_scalar(f"{event}/{key}/level_{level}", v, int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
