"""Settings every test process shares.

One OpenMP thread per process: the suite runs as several pytest workers (pytest.ini) on few cores, and each starts
trainer ranks and tools of its own. With torch's default of a thread per core, idle OpenMP threads spin on cores
that another process needs, and every kernel waits at its barrier for a thread that has lost its core. Tests that
need another count set OMP_NUM_THREADS in the environment of the process they start.
"""
import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the variable, which torch reads when it is first imported)

torch.set_num_threads(1)
