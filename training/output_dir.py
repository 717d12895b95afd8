"""One run writes an --output_dir at a time.

Rank 0 takes an exclusive lock on the folder (data/writer_lock.py: an flock that
the kernel releases when the process ends, however it ends, so a killed run
leaves no stale lock) once the flags and data have passed their checks and
before anything is written there, and holds it for the run's life. A refusal
(another live run holds it, naming its process and host; the folder cannot be
made or written) is not raised at once: rank 0 sends it to every rank over the
control plane, and all exit 2 together, having written nothing. Two runs in one
folder would each log checkpoints that hold the other's weights and interleave
their metrics.jsonl. A run refused later at start (a --resume path that cannot be
read, a checkpoint of another codec or other data) takes away the lock file, marker and folders it made and
puts back the lock file it found (`abandon`): a refused run leaves the disk as it found it.

The trainer writes only into a folder that is absent, empty, or one of its runs: one holding its marker
(MARKER, written when a run first claims the folder), or, for runs from before the marker, a config.json it
wrote (RunFolder.holds_a_run, training/run_folder.py) or nothing but the names a run writes. Anything else (a model
folder given as --output_dir, another program's output) is refused before anything is written, naming what is
there: a run would replace its config.json.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path


from data.dump_writer import output_folder
from data.stores import MANIFEST_ELSEWHERE
from data.writer_lock import OutputBusy, WriterLock
from errors import BadInputError
from training.distributed import DistContext, raise_together, rank0_decides
from training.nccl_env import FLIGHT_RECORDER_DIR
from training.run_folder import CHECKPOINTS, CONFIG, LOCK_FILE, MARKER, METRICS, TENSORBOARD, RunFolder

# what a run writes besides config.json: its marker and lock, metrics, checkpoints, TensorBoard, NCCL traces, and
# read-only folder stores' lengths manifests (data/stores.py manifest_path, and their temporary names)
RUN_NAMES = re.compile("^(" + "|".join(map(re.escape, (LOCK_FILE, MARKER, METRICS, CHECKPOINTS, TENSORBOARD)))
                       + rf"|{FLIGHT_RECORDER_DIR}|{MANIFEST_ELSEWHERE.pattern})$")
SHOWN = 5  # names of foreign files a refusal lists


def foreign_contents(folder: Path) -> str | None:
    """What makes `folder` not a run of this trainer, in words; None when it is absent, empty or a run."""
    if not folder.is_dir() or RunFolder(folder).holds_a_run():
        return None
    names = sorted(os.listdir(folder))
    if CONFIG in names:
        others = [n for n in names if n != CONFIG]
        return f"a {CONFIG} this trainer did not write" + (f", and {_listed(others)}" if others else "")
    others = [n for n in names if not RUN_NAMES.match(n)]
    return _listed(others) if others else None


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


class OutputDirLock:
    """`take()` on rank 0 (a refusal kept, not raised), then `agree(ctx)` on every rank; `release()` at the end."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.folder, self.rank = Path(output_dir), rank
        self.run = RunFolder(self.folder)  # its lock file and marker
        self.error: str | None = None
        self.busy = False  # the refusal is another run's lock, not a folder that cannot be written
        self._lock = WriterLock(self.run.lock, f"--output_dir {self.folder}")
        self.made: list[Path] = []  # the folders this run made, deepest first
        self.made_lock_file = self.made_marker = False
        self.lock_found: tuple[bytes, int, int] | None = None  # the lock file as found: content, atime, mtime

    def take(self) -> "OutputDirLock":
        if self.rank != 0:
            return self
        try:
            foreign = foreign_contents(self.folder)
            if foreign:
                self.error = (f"--output_dir {self.folder} is not a run of this trainer: it holds {foreign}. Give "
                              "an empty or new folder, or the --output_dir of one of this trainer's runs")
                return self
            self.made = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
            lock_file = self.run.lock
            self.made_lock_file = not lock_file.exists()
            if not self.made_lock_file:
                found = lock_file.stat()
                self.lock_found = (lock_file.read_bytes(), found.st_atime_ns, found.st_mtime_ns)
            output_folder(self.folder, "--output_dir")
            self._lock.acquire()
            self._mark()
        except OSError as e:
            self.error = (f"--output_dir {self.folder} cannot be made or written ({e.strerror}): give a folder this "
                          "process can write")
        except BadInputError as e:  # OutputBusy, a folder or a lock file that cannot be made
            self.error, self.busy = str(e), isinstance(e, OutputBusy)
        return self

    def _mark(self) -> None:
        """The marker that makes the folder this trainer's run, written once, under the lock."""
        marker = self.run.marker
        if not marker.exists():
            self.made_marker = True
            marker.write_text(json.dumps({"run_of": "rvq_seamless_gpu_cache_nccl.py",
                                          "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")

    def agree(self, ctx: DistContext) -> None:
        """Every rank learns rank 0's outcome; a refusal raises on every rank together (exit 2)."""
        self.error, self.busy = rank0_decides(ctx, (self.error, self.busy))
        raise_together(ctx, self.error, OutputBusy if self.busy else BadInputError)

    def release(self) -> None:
        self._lock.release()

    def abandon(self) -> None:
        """Release after a start that failed: the marker, the lock file and the folders this run made go again, a
        lock file it found is put back as it was (while still held; a folder that holds anything else stays)."""
        lock_file = self.run.lock
        if self._lock.held and self.made_marker:
            self.run.marker.unlink(missing_ok=True)
        if self._lock.held and self.made_lock_file:
            lock_file.unlink(missing_ok=True)
        elif self._lock.held and self.lock_found is not None:
            content, atime, mtime = self.lock_found
            lock_file.write_bytes(content)
            os.utime(lock_file, ns=(atime, mtime))
        self.release()
        for folder in self.made:
            try:
                folder.rmdir()
            except FileNotFoundError:  # never made: a parent's mkdir failed
                continue
            except OSError:
                break
