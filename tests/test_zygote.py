"""The tests' commands forked from a zygote (tests/zygote.py) end as a fresh interpreter's would."""
import subprocess
import sys

import pytest

from tests import zygote
from tests.helpers import REPO, env, run_python

CASES = {
    "exit code and argv": "import sys; print(sys.argv[1:]); sys.exit(3)",
    "an exception": "raise ValueError('broken')",
    "a message to SystemExit": "import sys; sys.exit('a message')",
    "a signal": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "Ctrl-C": "raise KeyboardInterrupt",
    "a thread joined at exit": ("import threading, time\n"
                                "threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()"),
    "atexit": "import atexit; atexit.register(print, 'at exit')",
    "its folder and environment": "import os; print(os.getcwd(), os.environ['RVQ_PROBE'])",
    "the project's modules imported afresh": "import errors, sys; print(errors.__name__ in sys.modules)",
}


@pytest.mark.parametrize("case", CASES)
def test_a_forked_command_ends_as_a_fresh_interpreter_does(case, tmp_path):
    argv = ["-c", CASES[case], "an argument"]
    environ = env(RVQ_PROBE="probe")
    assert zygote.zygote_for(environ, base=env()) is not None, "the zygote did not start: commands start fresh"
    forked = run_python(argv, env=environ, timeout=60, cwd=tmp_path)
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, env=environ,
                           cwd=tmp_path)
    assert forked.returncode == fresh.returncode, (forked.stderr, fresh.stderr)
    assert forked.stdout == fresh.stdout
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]  # the traceback's last line


def test_a_command_whose_environment_a_library_reads_at_import_starts_fresh():
    assert zygote.zygote_for(env(), base=env()) is not None
    assert zygote.zygote_for(env(OMP_NUM_THREADS="7"), base=env()) is None
    assert zygote.zygote_for(env(PYTHONPATH=str(REPO / "tests")), base=env()) is None
