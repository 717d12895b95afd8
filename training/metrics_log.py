"""metrics.jsonl: one JSON object per event, written by rank 0 only."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path | None):
        self._file = open(path, "a", buffering=1) if path is not None else None

    def write(self, event: str, step: int, **fields) -> None:
        if self._file is None:
            return
        record = {"event": event, "step": int(step), "time": round(time.time(), 3)}
        for key, value in fields.items():
            record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
