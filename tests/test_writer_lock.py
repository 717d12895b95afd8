"""The writer lock: a second live writer is refused with the holder named; a killed holder leaves no stale lock."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from data.writer_lock import OutputBusy, WriterLock, holder_record
from tests.helpers import env

HOLD = ("import sys, time\nfrom data.writer_lock import WriterLock\n"
        "lock = WriterLock(sys.argv[1], 'the test output').acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")


def hold(path):
    """A process holding the lock on `path`, started as a tool is: `python -m MODULE ARGS`."""
    (path.parent / "hold_lock.py").write_text(HOLD)
    proc = subprocess.Popen([sys.executable, "-m", "hold_lock", str(path)], cwd=path.parent, env=env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_a_second_writer_is_refused_naming_the_first_and_a_killed_first_leaves_no_stale_lock(tmp_path):
    path = tmp_path / ".lock"
    first = hold(path)
    try:
        with pytest.raises(OutputBusy, match=rf"the test output is being written by another process \(pid "
                                             rf"{first.pid} on host .*: python[\d.]* -m hold_lock "
                                             rf"{re.escape(str(path))}\)"):
            WriterLock(path, "the test output").acquire()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    with WriterLock(path, "the test output") as lock:  # the kernel released it with the process
        assert lock.held and f'"pid": {os.getpid()}' in path.read_text()
    assert not lock.held


def test_a_stopped_writer_still_holds_its_lock(tmp_path):
    path = tmp_path / ".lock"
    first = hold(path)
    try:
        first.send_signal(signal.SIGSTOP)  # stopped, not dead: its output is still its own
        time.sleep(0.2)
        with pytest.raises(OutputBusy):
            WriterLock(path, "the test output").acquire()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)


def test_the_holder_is_named_by_the_command_as_typed(monkeypatch):
    """Under `python -m tools.tokenize`, sys.argv[0] is tools/tokenize.py, which run as a script shadows the standard
    library's tokenize: the lock names the command typed, quoted for a shell, and a launcher's rank."""
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python3", "-m", "tools.tokenize", "/data/My Recordings [2024]",
                                           "train", "1", "0", "out"])
    monkeypatch.setattr(sys, "argv", ["/repo/tools/tokenize.py", "/data/My Recordings [2024]", "train", "1", "0",
                                      "out"])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert holder_record()["command"] == "python3 -m tools.tokenize '/data/My Recordings [2024]' train 1 0 out"
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python3.11", "-u", "-m", "tools.extract", "a", "t", "1", "0",
                                           "o"])  # as torchrun starts each process
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert holder_record()["command"] == "python3.11 -u -m tools.extract a t 1 0 o (rank 3 of 8 under a launcher)"
