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
read, a checkpoint of another codec) takes away the lock file and folders it made
(`abandon`): a refused run leaves the disk as it found it.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from data.writer_lock import OutputBusy, WriterLock
from errors import BadInputError
from training.distributed import DistContext

LOCK_FILE = ".lock"  # in the output dir; it holds who has the lock (pid, host, command)


class OutputDirLock:
    """`take()` on rank 0 (a refusal kept, not raised), then `agree(ctx)` on every rank; `release()` at the end."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.folder, self.rank = Path(output_dir), rank
        self.error: str | None = None
        self.busy = False  # the refusal is another run's lock, not a folder that cannot be written
        self._lock = WriterLock(self.folder / LOCK_FILE, f"--output_dir {self.folder}")
        self.made: list[Path] = []  # the folders this run made, deepest first
        self.made_lock_file = False

    def take(self) -> "OutputDirLock":
        if self.rank != 0:
            return self
        try:
            self.made = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
            self.made_lock_file = not (self.folder / LOCK_FILE).exists()
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except FileExistsError:
            self.error = f"--output_dir {self.folder} is a file, not a folder: give a folder to write the run into"
        except OSError as e:
            self.error = (f"--output_dir {self.folder} cannot be made or written ({e.strerror}): give a folder this "
                          "process can write")
        except BadInputError as e:  # OutputBusy, or a lock file that cannot be made
            self.error, self.busy = str(e), isinstance(e, OutputBusy)
        return self

    def agree(self, ctx: DistContext) -> None:
        """Every rank learns rank 0's outcome; a refusal raises on every rank together (exit 2)."""
        if ctx.is_distributed:
            sent = [(self.error, self.busy)]
            dist.broadcast_object_list(sent, src=0, group=ctx.control)
            self.error, self.busy = sent[0]
        if self.error:
            refusal = OutputBusy if self.busy else BadInputError
            raise refusal(self.error if ctx.rank == 0 else f"rank 0: {self.error}")

    def release(self) -> None:
        self._lock.release()

    def abandon(self) -> None:
        """Release after a start that failed: the lock file and the folders this run made go again (the lock file
        while still held; a folder that holds anything else stays)."""
        if self._lock.held and self.made_lock_file:
            (self.folder / LOCK_FILE).unlink(missing_ok=True)
        self.release()
        for folder in self.made:
            try:
                folder.rmdir()
            except FileNotFoundError:  # never made: a parent's mkdir failed
                continue
            except OSError:
                break
