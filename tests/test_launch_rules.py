"""tools/launch_rules.py: how ranks meet, decided once for the launcher and the doctor, and every problem told."""
import subprocess

import pytest

from tests.helpers import REPO
from tests.test_launcher import launch_env
from tools import doctor
from tools.launch_rules import LaunchEnvError, Problems, plan_launch


@pytest.mark.parametrize("environ, gpus, expected", [
    ({}, 0, None),  # one process, no torchrun
    ({}, 4, ("static", "MASTER_ADDR", "127.0.0.1", None, 0)),  # a rank per GPU; the launcher picks a free port
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, 8, ("static", "MASTER_ADDR", "10.0.0.1", 29500, 1)),
    ({"MAX_RESTARTS": "1"}, 0, ("c10d", "MASTER_ADDR", "127.0.0.1", None, None)),  # restarts: a store per attempt
    ({"RDZV_ENDPOINT": "10.0.0.1", "NNODES": "1:4"}, 0, ("c10d", "RDZV_ENDPOINT", "10.0.0.1", 29400, None)),
])
def test_how_the_ranks_meet(environ, gpus, expected):
    rdzv = plan_launch(environ, gpus).rendezvous
    assert (rdzv and (rdzv.backend, rdzv.variable, rdzv.host, rdzv.port, rdzv.node_rank)) == expected


@pytest.mark.slow
def test_every_problem_is_told_at_once_and_the_launcher_and_the_doctor_tell_the_same(capsys):
    environ = {"NNODES": "2", "MASTER_PORT": "70000", "NPROC_PER_NODE": "two"}
    with pytest.raises(LaunchEnvError) as raised:
        plan_launch(environ, 0)
    problems = raised.value.problems
    assert [p.split(":")[0] for p in problems] == ["NPROC_PER_NODE=two", "NNODES=2 needs MASTER_ADDR",
                                                   "MASTER_PORT=70000", "NNODES=2 needs NODE_RANK"]
    collected = Problems()
    plan_launch(environ, 0, collected)  # the doctor's way: kept, not raised
    assert collected.found == problems
    report = doctor.Report()
    doctor.check_launch(environ, report, cuda=False, gpus=0)
    assert report.problems == problems
    capsys.readouterr()
    r = subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), "basic"], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=launch_env(**environ))
    assert r.returncode == 2
    assert [line for line in r.stderr.splitlines() if not line.startswith("[run_nccl_optimized] warning")] == [
        f"[run_nccl_optimized] {p}" for p in problems]
