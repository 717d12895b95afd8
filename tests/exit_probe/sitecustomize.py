"""Imported at start-up by a test's subprocess with this folder on PYTHONPATH (tests.helpers.EXIT_PROBE): at the
interpreter's exit (atexit, after its non-daemon threads are joined) it prints how many OS threads the process
still has, and their names. A transport thread still running there (gloo's, NCCL's, the store's) is one the
interpreter's teardown and the C++ static destructors would race with."""
import atexit
import os
import sys


def _report() -> None:
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    sys.stderr.write(f"exit probe: {len(names)} thread(s) {names}\n")
    sys.stderr.flush()


if os.path.isdir("/proc/self/task"):
    atexit.register(_report)
