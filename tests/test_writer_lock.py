"""The writer lock: a second live writer is refused with the holder named; a killed holder leaves no stale lock."""
import os
import signal
import subprocess
import sys
import time

import pytest

from data.writer_lock import OutputBusy, WriterLock
from tests.helpers import REPO, env

HOLD = ("import sys, time\nfrom data.writer_lock import WriterLock\n"
        "lock = WriterLock(sys.argv[1], 'the test output').acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")


def hold(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_a_second_writer_is_refused_naming_the_first_and_a_killed_first_leaves_no_stale_lock(tmp_path):
    path = tmp_path / ".lock"
    first = hold(path)
    try:
        with pytest.raises(OutputBusy, match=rf"the test output is being written by another process \(pid "
                                             rf"{first.pid} on host .*-c .*\.lock"):
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
