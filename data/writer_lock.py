"""One writer per output: an exclusive OS lock that a second writer cannot take.

A run holds the lock on its --output_dir, a tool the lock on each shard it writes, for as long as it
writes. The lock is `flock` on a small file beside the output: the kernel releases it when the process
ends, however it ends (SIGKILL, OOM killer, a node reboot), so a dead writer never leaves a stale lock,
only the file, which the next writer takes over. The file holds who has it (pid, host, the command as typed,
start time), read by a writer that finds it taken so that the message names the other process. On NFS, Linux
maps flock to the server's byte-range locks (NFSv4, or v3 with lockd), which also die with the holder.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
import weakref
from pathlib import Path

from errors import BadInputError


_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()  # the locks this process holds, for a forked child to drop


def _drop_in_child() -> None:
    """In a forked child: close its copies of the held locks' descriptors, so that it never holds a lock."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_drop_in_child)


class OutputBusy(BadInputError):
    """Another live process holds the lock on this output: exit 2, nothing touched."""


class WriterLock:
    """`with WriterLock(path, "the run directory X"):` holds the lock on `path` (created if missing) for the
    block; `acquire()` / `release()` for a lock held across functions. Raises OutputBusy when another
    process holds it."""

    def __init__(self, path: Path | str, what: str, overwrite_hint: str = ""):
        self.path, self.what, self.hint = Path(path), what, overwrite_hint
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WriterLock:
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BadInputError(f"cannot create the lock file {self.path} for {self.what}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BadInputError(f"cannot lock {self.path} for {self.what}: {e.strerror}") from e
            raise OutputBusy(f"{self.what} is being written by another process ({self.holder()}); two writers "
                             f"would mix their files: wait for it to end, or stop it, or write elsewhere"
                             + (f" ({self.hint})" if self.hint else "")) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(holder_record()) + "\n").encode())
        except OSError:
            pass  # the record only names the holder: a full disk must not stop the writer that holds the lock
        self._fd = fd
        _HELD.add(self)
        return self

    def release(self) -> None:
        """Let go of the lock (the file stays: removing it would race a writer that has just opened it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        os.close(fd)  # closing the only descriptor releases the flock

    def taken(self) -> bool:
        """Whether another process holds the lock now: only tested (a shared lock, let go at once), never taken."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # no lock file: no writer ever held it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        finally:
            os.close(fd)  # closing the descriptor lets go of the shared lock
        return False

    def holder(self) -> str:
        """Who holds the lock, as its file says, in words."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return "a process that has not said who it is"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
        return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, since {started}: "
                f"{record.get('command', '?')}")

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": typed_command()[:500]}


def typed_command() -> str:
    """This process's command as it was typed (`python -m tools.tokenize ...`, quoted for a shell), and its rank
    under a launcher (torchrun starts each as `python -u -m ...`). sys.argv holds a module's file path under -m,
    and `python tools/tokenize.py` fails: tools/ on sys.path puts it in place of the standard library's tokenize."""
    interpreter, *args = sys.orig_argv
    typed = shlex.join([os.path.basename(interpreter), *args])
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return f"{typed} (rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} under a launcher)"
    return typed
