"""The doctor: variables NCCL ignores or PyTorch renamed, the interface NCCL picks, and launches that would fail."""
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO, env, free_port
from tools import doctor

LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT",
               "MAX_RESTARTS", "ALLOW_LOOPBACK_MASTER", "DATA_DIR", "OUTPUT_DIR")


def clean_env(**extra) -> dict:
    e = env(**extra)
    for name in list(e):
        if (name in LAUNCH_VARS or name.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_"))) and name not in extra:
            del e[name]
    return e


def run_doctor(*command, **extra):
    command = command or (sys.executable, "-m", "tools.doctor")
    return subprocess.run(list(command), capture_output=True, text=True, timeout=120, env=clean_env(**extra), cwd=REPO)


@pytest.mark.slow
def test_launcher_doctor_explains_nccl_timeout_and_renamed_variables_and_passes():
    r = run_doctor("bash", str(REPO / "run_nccl_optimized.sh"), "doctor", NCCL_TIMEOUT="1800",
                   NCCL_ASYNC_ERROR_HANDLING="1", NCCL_BLOCKING_WAIT="1", NPROC_PER_NODE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "NCCL does not read NCCL_TIMEOUT" in out
    assert "the trainer uses it as the process-group timeout" in out
    assert "NCCL_ASYNC_ERROR_HANDLING=1: PyTorch renamed it to TORCH_NCCL_ASYNC_ERROR_HANDLING" in out
    assert "NCCL_BLOCKING_WAIT=1: PyTorch renamed it to TORCH_NCCL_BLOCKING_WAIT" in out
    import torch

    assert f"torch {torch.__version__}" in out
    assert "NCCL would use:" in out and "skips lo and docker*, prefers ib*" in out
    assert "is free on 127.0.0.1" in out
    assert "ok: nothing found that would stop a launch" in out


@pytest.mark.slow
def test_unresolvable_master_addr_exits_1_with_the_reason():
    r = run_doctor(NPROC_PER_NODE="2", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29500")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL: MASTER_ADDR=no-such-host.invalid does not resolve" in r.stdout
    assert "a launch would fail (1 problem(s))" in r.stdout


@pytest.mark.slow
def test_master_port_in_use_on_this_host_exits_1():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = run_doctor(NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAIL: port {port} is in use on 127.0.0.1" in r.stdout


# ---- the checks themselves, without a subprocess


def test_env_warnings_name_every_renamed_variable_and_leave_documented_ones_alone():
    warnings = doctor.env_warnings({**{old: "1" for old in doctor.RENAMED}, "NCCL_RINGS": "0 1|1 0",
                                    "NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": "0",
                                    "NCCL_P2P_DISABLE": "0", "NCCL_IB_DISABLE": "1"})
    text = "\n".join(warnings)
    for old, new in doctor.RENAMED.items():
        assert f"{old}=1: PyTorch renamed it to {new}" in text
    assert "both are set, to different values (TORCH_NCCL_BLOCKING_WAIT=0): remove NCCL_BLOCKING_WAIT" in text
    assert "NCCL_RINGS" in text
    assert "NCCL_IB_DISABLE=1 is a workaround" in text
    assert "NCCL_P2P_DISABLE" not in text and "NCCL_DEBUG" not in text
    assert doctor.env_warnings({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_SOCKET_IFNAME": "eth0"}) == []


@pytest.mark.parametrize("addrs, ifname, expected", [
    ({"lo": ["127.0.0.1/8"], "docker0": ["172.17.0.1/16"], "eth0": ["10.0.0.2/24"], "ib0": ["10.1.0.2/24"]},
     None, ["ib0"]),  # ib* first
    ({"lo": ["127.0.0.1/8"], "docker0": ["172.17.0.1/16"], "eth0": ["10.0.0.2/24"], "eth1": ["10.2.0.2/24"]},
     None, ["eth0"]),  # else the first that is not lo or docker*
    ({"lo": ["127.0.0.1/8"], "ifb0": [], "eth0": ["fe80::1/64"], "docker0": ["172.17.0.1/16"]},
     None, ["docker0"]),  # no address (or only link-local) does not count
    ({"lo": ["127.0.0.1/8"]}, None, ["lo"]),
    ({"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.2/24"], "eth1": ["10.2.0.2/24"]}, "eth", ["eth0", "eth1"]),
    ({"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.2/24"], "eth10": ["10.2.0.2/24"]}, "=eth1", []),
    ({"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.2/24"], "docker0": ["172.17.0.1/16"]}, "^docker,lo", ["eth0"]),
])
def test_nccl_interface_choice_follows_nccls_documented_rule(addrs, ifname, expected):
    assert doctor.nccl_interfaces(addrs, ifname) == expected


def problems(environ, *, cuda=False, gpus=0):
    report = doctor.Report()
    doctor.check_launch(environ, report, cuda=cuda, gpus=gpus)
    return report.problems


def test_more_ranks_than_visible_gpus_would_fail_on_a_cuda_machine(capsys):
    assert any("NPROC_PER_NODE=4 but only 2 GPU(s) are visible" in p
               for p in problems({"NPROC_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, cuda=True, gpus=2))
    assert problems({"NPROC_PER_NODE": "2"}, cuda=True, gpus=2) == []
    assert problems({"NPROC_PER_NODE": "2"}, cuda=False, gpus=0) == []  # gloo ranks on the CPU


@pytest.mark.parametrize("environ, message", [
    ({"NNODES": "2", "NODE_RANK": "0"}, "needs MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "needs NODE_RANK"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "node ranks run from 0 to 1"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "loopback address"),
    ({"NPROC_PER_NODE": "0"}, "expected a whole number >= 1"),
    ({"RDZV_ENDPOINT": "no-such-host.invalid:29400", "NNODES": "1:2"}, "does not resolve"),
    ({"RDZV_ENDPOINT": "localhost:29400", "NNODES": "2"}, "set ALLOW_LOOPBACK_MASTER=1"),
    ({"RDZV_ENDPOINT": "10.0.0.1:rdzv", "NNODES": "2"}, "RDZV_ENDPOINT=10.0.0.1:rdzv: expected HOST:PORT"),
])
def test_launches_that_cannot_work(environ, message, capsys):
    assert any(message in p for p in problems(environ)), capsys.readouterr().out


@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_a_loopback_master_passes_for_a_drill_with_every_node_on_this_host(node_rank, capsys):
    environ = {"NNODES": "2", "NODE_RANK": node_rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "ALLOW_LOOPBACK_MASTER": "1"}
    assert problems(environ) == []
    assert "ALLOW_LOOPBACK_MASTER=1: a loopback master, for a drill with every node on this host" in \
        capsys.readouterr().out


# ---- the address gloo binds: GLOO_SOCKET_IFNAME, the trainer's choice across nodes, or the host name's address

ADDRS = {"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.2/24"]}
DEBIAN_HOSTS = ["127.0.1.1"]  # Debian's /etc/hosts: "127.0.1.1 <hostname>"


def gloo_problems(monkeypatch, environ, host_addrs, addrs=ADDRS):
    monkeypatch.setattr(doctor, "resolve", lambda host, timeout=None: (host_addrs, None))
    report = doctor.Report()
    doctor.check_gloo(environ, addrs, report)
    return report.problems


def test_a_host_name_on_a_loopback_address_fails_when_gloo_would_bind_it_across_nodes(monkeypatch, capsys):
    # NCCL_SOCKET_IFNAME names no interface here, so the trainer has none for gloo: gloo binds the host name's address
    environ = {"NNODES": "2", "NCCL_SOCKET_IFNAME": "ib"}
    [problem] = gloo_problems(monkeypatch, environ, DEBIAN_HOSTS)
    assert "-> 127.0.1.1, a loopback address" in problem and "the other nodes cannot reach it" in problem
    assert "set GLOO_SOCKET_IFNAME" in problem and "/etc/hosts" in problem
    assert gloo_problems(monkeypatch, {**environ, "NNODES": "1"}, DEBIAN_HOSTS) == []  # one node: it works
    assert gloo_problems(monkeypatch, {**environ, "ALLOW_LOOPBACK_MASTER": "1"}, DEBIAN_HOSTS) == []  # a drill
    assert gloo_problems(monkeypatch, environ, ["10.0.0.2"]) == []
    capsys.readouterr()


def test_across_nodes_gloo_binds_the_interface_the_trainer_picks(monkeypatch, capsys):
    assert gloo_problems(monkeypatch, {"NNODES": "2"}, DEBIAN_HOSTS) == []
    out = capsys.readouterr().out
    assert "gloo binds eth0 (set by the trainer when its ranks span nodes: the interface NCCL picks by default)" in out
    assert "ranks started without torchrun or srun" in out  # the host name's address still bites those


@pytest.mark.parametrize("environ, message", [
    ({"GLOO_SOCKET_IFNAME": "eth9"}, "GLOO_SOCKET_IFNAME=eth9: no interface eth9 with an address on this host"),
    ({"GLOO_SOCKET_IFNAME": "lo", "NNODES": "2"}, "gloo would bind lo, a loopback interface"),
    ({"NCCL_SOCKET_IFNAME": "lo", "NNODES": "2"}, "gloo would bind lo, a loopback interface"),
])
def test_a_gloo_interface_that_cannot_work(monkeypatch, environ, message, capsys):
    assert any(message in p for p in gloo_problems(monkeypatch, environ, ["10.0.0.2"])), capsys.readouterr().out
