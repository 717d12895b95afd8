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
from training.run_folder import RunFolder


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


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The events of a metrics.jsonl in the order written, each step an int, and the number of lines that are no
    event (not JSON, no "event" or "step", a step that is no finite number), which are skipped. Read by the tools,
    the benchmarks, .ci and the tests: the one reader of what MetricsLog writes."""
    events, bad = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, record["event"] = record["step"], str(record["event"])
        except (ValueError, KeyError, TypeError, IndexError):
            bad += 1
            continue
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
            bad += 1  # "step": 1e400 reads as inf
            continue
        record["step"] = int(step)
        events.append(record)
    return events, bad


def run_events(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The events of a run's metrics.jsonl (those of `kind`, if given), in the order written."""
    events, _ = read_metrics(RunFolder(run_dir).metrics)
    return [e for e in events if kind is None or e["event"] == kind]
