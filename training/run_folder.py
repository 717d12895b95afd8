"""The layout of a run's --output_dir: every path the trainer writes there, named in one place.

The trainer, the tools, the benchmarks, .ci and the tests find a run's files through `RunFolder`; the names are
also what tells a run's folder from anything else (training/output_dir.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LOCK_FILE = ".lock"  # who holds the folder (pid, host, command): data/writer_lock.py
MARKER = ".rvq_run"  # this trainer's run lives here
CONFIG = "config.json"  # the run's flags (training/config.py save_config)
METRICS = "metrics.jsonl"  # one JSON object per event (training/metrics_log.py)
CHECKPOINTS = "checkpoints"  # step_XXXXXXXX.pt (training/checkpoint.py)
TENSORBOARD = "tensorboard"  # --tensorboard's scalars


# RunFolder's paths: attribute -> name in the folder
PATHS = {"lock": LOCK_FILE, "marker": MARKER, "config": CONFIG, "metrics": METRICS, "checkpoints": CHECKPOINTS,
         "tensorboard": TENSORBOARD}


@dataclass(frozen=True)
class RunFolder:
    """A run's output folder (`root`) and the paths in it, one attribute each (PATHS)."""

    root: Path
    lock: Path = field(init=False)
    marker: Path = field(init=False)
    config: Path = field(init=False)
    metrics: Path = field(init=False)
    checkpoints: Path = field(init=False)
    tensorboard: Path = field(init=False)

    def __post_init__(self):
        root = Path(self.root)
        object.__setattr__(self, "root", root)
        for attribute, name in PATHS.items():
            object.__setattr__(self, attribute, root / name)

    def holds_a_run(self) -> bool:
        """Whether `root` is one of this trainer's runs: it holds the marker or, a run from before the marker, a
        config.json the trainer wrote."""
        return self.marker.exists() or written_by_trainer(self.config)


def written_by_trainer(path) -> bool:
    """Whether `path` is a config.json this trainer wrote (training/config.py save_config): a JSON object holding
    the run section's flags, which every version has written. A folder holding another program's config.json is not
    a run."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return False
    return isinstance(values, dict) and {"output_dir", "resume", "save_every"} <= set(values)
