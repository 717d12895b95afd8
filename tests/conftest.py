"""Settings every test process shares.

One OpenMP thread per process: the suite runs as several pytest workers (pytest.ini) on few cores, and each starts
trainer ranks and tools of its own. With torch's default of a thread per core, idle OpenMP threads spin on cores
that another process needs, and every kernel waits at its barrier for a thread that has lost its core. Tests that
need another count set OMP_NUM_THREADS in the environment of the process they start.

Compiled steps on the CPU build their kernels unvectorized and in the compiling process: on a cold inductor cache
(a clean machine) gcc's build of the vectorized kernels and the start of inductor's pool of compile workers took
most of each compile's time. The tests check graphs, breaks and numbers, not the kernels' speed.

A suite started as an asynchronous command of a script (`pytest &` in bash without job control) inherits SIGINT
ignored, and so would every process it starts, where Python leaves it ignored: the tests of Ctrl-C would see a tool
that cannot be stopped by it. The test processes take SIGINT back, so that the processes they start get its
default, as from a terminal.
"""
import os
import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import torch  # noqa: E402  (after the variable, which torch reads when it is first imported)

torch.set_num_threads(1)

import pytest  # noqa: E402

from tests.helpers import write_dump  # noqa: E402


def pytest_collection_modifyitems(items):
    """The tests marked `long` run first (a stable sort, the rest in their order): the workers (pytest.ini) start
    them while there is other work to share, and the suite ends on short tests, not on one worker alone in a long
    one."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A fairseq dump of 60 training utterances of 40-199 frames and 6 held-out ones of 64, 16-d."""
    return write_dump(tmp_path_factory.mktemp("data"), train=60, valid=6, seed=1)
