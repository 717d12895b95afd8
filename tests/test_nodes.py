"""Several nodes, checked on one host: how many nodes a rank's launcher reports, the interface gloo binds
across nodes, and two launchers as the two nodes of one job (a stop by signal, then a resume)."""
import contextlib
import logging
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import QUICK, REPO, TINY, events, free_port
from tests.test_launcher import launch_env
from tools.launch import child_processes
from training import distributed
from training.distributed import bind_gloo_across_nodes, detect_launch

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

ADDRS = {"lo": ["127.0.0.1/8"], "docker0": ["172.17.0.1/16"], "eth0": ["10.0.0.2/24"], "eth1": ["10.2.0.2/24"]}


@pytest.mark.parametrize("launcher_env, nodes", [
    ({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "GROUP_WORLD_SIZE": "2"}, 2),  # torchrun
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 1),  # set by hand: nothing says how many nodes
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "4"}, 4),  # srun
])
def test_the_number_of_nodes_comes_from_the_launcher(monkeypatch, launcher_env, nodes):
    monkeypatch.setattr(os, "environ", dict(launcher_env))  # detect_launch writes RANK etc. for srun
    assert detect_launch().nodes == nodes


@pytest.mark.parametrize("nodes, environ, expected", [
    (2, {}, "eth0"),  # NCCL's own choice: not lo, not docker*
    (2, {"NCCL_SOCKET_IFNAME": "eth1"}, "eth1"),  # NCCL's interface, as the user named it
    (2, {"NCCL_SOCKET_IFNAME": "^eth0,docker,lo"}, "eth1"),
    (2, {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth0"}, "eth0"),  # the user's own wins
    (2, {"NCCL_SOCKET_IFNAME": "ib"}, None),  # no such interface: gloo keeps its default
    (1, {"NCCL_SOCKET_IFNAME": "eth1"}, None),  # one node: gloo's default works
])
def test_gloo_binds_the_interface_nccl_uses_when_ranks_span_nodes(monkeypatch, caplog, nodes, environ, expected):
    monkeypatch.setattr(os, "environ", dict(environ))
    monkeypatch.setattr(distributed, "interface_addresses", lambda: ADDRS)
    with caplog.at_level(logging.INFO):
        bind_gloo_across_nodes(distributed.Launch(rank=0, world_size=2 * nodes, local_rank=0, nodes=nodes))
    assert os.environ.get("GLOO_SOCKET_IFNAME") == expected
    if nodes > 1 and expected is None:
        assert "GLOO_SOCKET_IFNAME unset and no interface with an address to set it to" in caplog.text


class TwoNodes:
    """Two launchers on this host, node ranks 0 and 1 of one job (ALLOW_LOOPBACK_MASTER=1), one rank each;
    each node's output in its own file."""

    def __init__(self, log_dir, out, args, **extra_env):
        port = free_port()
        self.logs = [log_dir / f"node{node}.log" for node in (0, 1)]
        self.procs = []
        for node, log in enumerate(self.logs):
            e = launch_env(NNODES=2, NODE_RANK=node, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           ALLOW_LOOPBACK_MASTER=1, OUTPUT_DIR=out, OMP_NUM_THREADS=1, **extra_env)
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(["bash", str(REPO / "run_nccl_optimized.sh"), "basic",
                                                    *map(str, args)], stdout=f, stderr=subprocess.STDOUT, env=e,
                                                   cwd=REPO))

    def output(self, node) -> str:
        return self.logs[node].read_text()

    def wait(self, timeout) -> list:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def close(self):
        """End whatever is left: each launcher, the torchrun it started (in a session of its own), its ranks."""
        for p in self.procs:
            if p.poll() is None:
                tree, parents = [], [p.pid]
                while parents:
                    tree += parents
                    parents = [child for pid in parents for child in child_processes(pid)]
                for pid in reversed(tree):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                p.wait(timeout=30)


def wait_for_train_step(out, step, nodes: TwoNodes, timeout) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists() or not any(e["step"] >= step for e in events(out, "train")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs), \
            nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
        time.sleep(0.5)


@pytest.mark.long
@pytest.mark.timeout(200)
def test_two_nodes_on_this_host_stop_together_on_sigterm_and_resume(tmp_path):
    """The README's two-node drill. SIGTERM to node 1's launcher stops both nodes at one step, with one
    checkpoint; both launchers exit 0 and nothing restarts (MAX_RESTARTS=1, a c10d rendezvous). Relaunched
    with a static master (the README's two-node command), both resume from that step and finish."""
    out = tmp_path / "run"
    # --compile off: a run of 1000 steps would compile its step on a CPU (--compile auto), the subject of
    # tests/test_compiled_step.py and tests/test_stops.py, not of this drill
    flags = [*TINY, *QUICK, "--sync_check_every", "2", "--save_every", "1000", "--eval_every", "1000",
             "--compile", "off"]
    first = TwoNodes(tmp_path / "first", out, [*flags, "--max_steps", "1000"], MAX_RESTARTS=1)
    try:
        wait_for_train_step(out, 4, first, timeout=90)
        first.procs[1].send_signal(signal.SIGTERM)
        codes = first.wait(timeout=60)
    finally:
        first.close()
    logs = [first.output(0), first.output(1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "SIGTERM: passed to this node's ranks" in logs[1]
    assert not any("will restart worker group" in log for log in logs)
    stop = events(out, "stop")[-1]
    step = stop["step"]
    assert stop["reason"] in ("signal on rank(s) [0]", "signal on rank(s) [1]")  # c10d picks the node ranks
    assert step >= 4
    assert [e["step"] for e in events(out, "checkpoint")] == [step]

    second = TwoNodes(tmp_path / "second", out, [*flags, "--max_steps", step + 4])
    try:
        codes = second.wait(timeout=90)
    finally:
        second.close()
    logs = [second.output(0), second.output(1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"resumed from {out}/checkpoints/step_{step:08d}.pt at step {step}" in logs[0]
    # node 1's rank resumed at the same step: sync checks every 2 steps compare the ranks' steps, and a mismatch
    # would have ended both with exit code 3
    assert [e["step"] for e in events(out, "train")][-4:] == [step + 1, step + 2, step + 3, step + 4]
    assert events(out, "stop")[-1]["step"] == step + 4
