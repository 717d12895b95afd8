"""run_nccl_optimized.sh: presets from training/presets.py, the environment it resolves, torchrun or one process."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import QUICK, REPO, TINY, TRAINER, env, events, run_trainer, signal_while_importing
from training.nccl_env import TRAINER_NCCL_ENV
from training.presets import PRESETS

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

# variables of this machine that would change what the launcher prints
LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID",
               "MAX_RESTARTS", "ALLOW_LOOPBACK_MASTER", "OMP_NUM_THREADS", "DATA_DIR", "OUTPUT_DIR", "DRY_RUN",
               "SLURM_JOB_ID")


def launch_env(**extra_env) -> dict:
    """This machine's environment without its launch variables, plus `extra_env`."""
    e = env(**extra_env)
    for name in list(e):
        if (name in LAUNCH_VARS or name.startswith(("NCCL_", "TORCH_", "GLOO_"))) and name not in extra_env:
            del e[name]
    return e


def launch(*args, timeout=240, cwd=REPO, **extra_env):
    return subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=launch_env(**extra_env), cwd=cwd)


def dry_run(*args, **extra_env):
    """(exported variables, command as a list, the messages) of a DRY_RUN; stdout is a script to paste."""
    r = launch(*args, timeout=60, DRY_RUN=1, **extra_env)
    assert r.returncode == 0, r.stderr
    exports = dict(line[len("export "):].split("=", 1) for line in r.stdout.splitlines() if line.startswith("export "))
    command = shlex.split(r.stdout.split("# command\n", 1)[1])
    trainer_env = dict(line[len("#   "):].split("=", 1) for line in r.stdout.splitlines() if line.startswith("#   "))
    exports = {k: shlex.split(v)[0] if v else "" for k, v in exports.items()}
    return exports, command, r.stderr + "".join(f"\ntrainer sets {k}={v}" for k, v in trainer_env.items())


def value_after(command, flag):
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("args", [[], ["turbo"]])
def test_no_or_unknown_preset_prints_usage_and_exits_2(args):
    r = launch(*args)
    assert r.returncode == 2
    assert "usage: bash run_nccl_optimized.sh PRESET" in r.stderr
    assert "run_nccl_optimized.sh doctor" in r.stderr
    for name in PRESETS:
        assert name in r.stderr


@pytest.mark.parametrize("preset", list(PRESETS))
def test_dry_run_prints_each_presets_flags_and_environment_and_starts_nothing(preset, tmp_path):
    out = tmp_path / "run"
    exports, command, stderr = dry_run(preset, "--max_steps", "7", OUTPUT_DIR=out)
    assert not out.exists()  # nothing started, nothing written
    assert command[1].endswith("rvq_seamless_gpu_cache_nccl.py")  # one process without GPUs or NPROC_PER_NODE
    trainer_args = command[2:]
    preset_flags = list(PRESETS[preset].flags)
    assert trainer_args == ["--output_dir", str(out), *preset_flags, "--max_steps", "7"]
    workarounds = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}
    if preset == "conservative":
        assert {k: exports[k] for k in workarounds} == workarounds
        assert "NCCL_IB_DISABLE=1: a workaround from NCCL's troubleshooting guide" in stderr
    else:
        assert not set(workarounds) & set(exports)
        assert "workaround" not in stderr
    assert "OMP_NUM_THREADS" not in exports  # one rank on the CPU: the trainer picks its threads
    assert "OMP_NUM_THREADS left unset: one rank on the CPU picks its threads" in stderr
    assert exports["PYTHONPATH"].split(":")[0] == str(REPO)
    # the trainer's flight-recorder settings, shown with this run's dump path, from training/nccl_env.py
    for name, value in TRAINER_NCCL_ENV.items():
        assert f"trainer sets {name}={value or f'{out}/nccl_traces/rank_'}" in stderr


def test_preset_flags_come_first_and_user_flags_win(tmp_path):
    out = tmp_path / "run"
    r = launch("conservative", *TINY, *QUICK, "--max_steps", "3", "--batch_size", "2", OUTPUT_DIR=out)
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["batch_size"] == 2  # the user's, after the preset's 16
    assert config["nccl_timeout"] == 3600 and config["pin_memory"] is False
    assert "NCCL_IB_DISABLE=1: a workaround" in r.stderr
    assert "torch.distributed.run" not in r.stderr  # one process without GPUs
    assert events(out, "stop")[-1]["step"] == 3


def test_user_environment_wins_over_preset(tmp_path):
    exports, command, stderr = dry_run("conservative", OUTPUT_DIR=tmp_path / "run", NCCL_P2P_DISABLE="0",
                                       OMP_NUM_THREADS="3", TORCH_NCCL_TRACE_BUFFER_SIZE="64",
                                       NCCL_SOCKET_IFNAME="eth0")
    assert "keeping NCCL_P2P_DISABLE=0 from your environment" in stderr
    assert exports["NCCL_P2P_DISABLE"] == "0" and exports["NCCL_IB_DISABLE"] == "1"
    assert exports["OMP_NUM_THREADS"] == "3" and "keeping OMP_NUM_THREADS=3" in stderr
    assert exports["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64" and "keeping TORCH_NCCL_TRACE_BUFFER_SIZE=64" in stderr
    assert exports["NCCL_SOCKET_IFNAME"] == "eth0" and "keeping NCCL_SOCKET_IFNAME=eth0" in stderr


def test_nccl_timeout_from_the_environment_wins_over_the_presets_flag(tmp_path):
    exports, command, stderr = dry_run("conservative", OUTPUT_DIR=tmp_path / "run", NCCL_TIMEOUT="1200")
    assert "--nccl_timeout" not in command  # so the trainer takes NCCL_TIMEOUT as its process-group timeout
    assert exports["NCCL_TIMEOUT"] == "1200"
    assert "warning: NCCL_TIMEOUT=1200: NCCL does not read NCCL_TIMEOUT" in stderr


def test_data_dir_and_default_output_dir(tmp_path):
    from tests.helpers import write_fairseq

    write_fairseq(tmp_path / "data", "train", [100] * 20)
    r = launch("basic", *TINY, "--max_steps", "2", timeout=200, cwd=tmp_path, DATA_DIR=tmp_path / "data")
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(tmp_path / "runs" / "basic", "stop")[-1]["step"] == 2


def test_ranks_on_one_node_use_torchrun_and_share_the_cores(tmp_path):
    exports, command, stderr = dry_run("prefetch", OUTPUT_DIR=tmp_path / "run", NPROC_PER_NODE=2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert value_after(command, "--nproc_per_node") == "2" and value_after(command, "--nnodes") == "1"
    assert value_after(command, "--master_addr") == "127.0.0.1"
    assert 1024 <= int(value_after(command, "--master_port")) <= 65535
    assert int(exports["OMP_NUM_THREADS"]) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert "no GPU visible: 2 ranks on the CPU, with gloo" in stderr


@pytest.mark.parametrize("node_rank", [0, 1])
def test_two_nodes_with_a_static_master_as_in_the_readme(node_rank, tmp_path):
    exports, command, stderr = dry_run("gpu_cache", "--multi_length_training", NNODES=2, NODE_RANK=node_rank,
                                       NPROC_PER_NODE=8, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500,
                                       DATA_DIR="/shared/feats", OUTPUT_DIR="/shared/runs/rvq")
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert [value_after(command, f) for f in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                                              "--master_port")] == ["8", "2", str(node_rank), "10.0.0.1", "29500"]
    assert "--rdzv_backend" not in command
    assert command[command.index("--output_dir"):] == ["--output_dir", "/shared/runs/rvq", "--data_dir",
                                                       "/shared/feats", "--use_gpu_cache", "--multi_length_training"]


def test_rdzv_endpoint_gives_a_c10d_rendezvous_with_one_id_for_every_node(tmp_path):
    exports, command, stderr = dry_run("basic", NNODES="2", NPROC_PER_NODE=8, RDZV_ENDPOINT="10.0.0.1:29400",
                                       OUTPUT_DIR="/shared/runs/rvq")
    assert [value_after(command, f) for f in ("--rdzv_backend", "--rdzv_endpoint", "--nnodes")] == [
        "c10d", "10.0.0.1:29400", "2"]
    assert value_after(command, "--rdzv_id") == "rvq--shared-runs-rvq"  # the same on every node
    assert "--master_addr" not in command and "--node_rank" not in command


@pytest.mark.parametrize("bad, message", [
    ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "NNODES=2 needs NODE_RANK"),
    ({"NNODES": "2", "NODE_RANK": "0"}, "NNODES=2 needs MASTER_ADDR"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "node ranks run from 0 to 1"),
    ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE=two: expected a whole number >= 1"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: expected a whole number >= 0"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
     "MASTER_ADDR=127.0.0.1 is a loopback address (127.0.0.1): the other nodes cannot reach it"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "localhost:29400"}, "set ALLOW_LOOPBACK_MASTER=1"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "10.0.0.1:rdzv"}, "RDZV_ENDPOINT=10.0.0.1:rdzv: expected HOST:PORT"),
])
def test_a_launch_that_cannot_work_exits_2_before_starting(bad, message, tmp_path):
    r = launch("basic", timeout=60, OUTPUT_DIR=tmp_path / "run", **bad)
    assert r.returncode == 2, r.stderr
    assert any(line.startswith("[run_nccl_optimized] ") and message in line for line in r.stderr.splitlines())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_loopback_master_is_accepted_for_a_drill_with_every_node_on_this_host(node_rank, tmp_path):
    exports, command, stderr = dry_run("basic", OUTPUT_DIR=tmp_path / "run", NNODES=2, NODE_RANK=node_rank,
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=29500, ALLOW_LOOPBACK_MASTER=1)
    assert [value_after(command, f) for f in ("--nnodes", "--node_rank", "--master_addr")] == [
        "2", str(node_rank), "127.0.0.1"]
    assert "ALLOW_LOOPBACK_MASTER=1: MASTER_ADDR=127.0.0.1 is a loopback address, so every node must run on this " \
           "host (a drill)" in stderr


def test_across_nodes_the_trainer_binds_gloo_to_the_interface_nccl_uses(tmp_path):
    nodes = dict(NNODES=2, NODE_RANK=0, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500)
    exports, command, stderr = dry_run("basic", OUTPUT_DIR=tmp_path / "run", NCCL_SOCKET_IFNAME="lo", **nodes)
    assert "trainer sets GLOO_SOCKET_IFNAME=lo" in stderr  # shown with the trainer's settings, not exported
    assert "GLOO_SOCKET_IFNAME" not in exports
    assert "the trainer sets GLOO_SOCKET_IFNAME=lo (NCCL_SOCKET_IFNAME=lo)" in stderr
    exports, command, stderr = dry_run("basic", OUTPUT_DIR=tmp_path / "run", NCCL_SOCKET_IFNAME="lo",
                                       GLOO_SOCKET_IFNAME="lo", **nodes)
    assert exports["GLOO_SOCKET_IFNAME"] == "lo" and "keeping GLOO_SOCKET_IFNAME=lo" in stderr
    assert "trainer sets GLOO_SOCKET_IFNAME" not in stderr
    exports, command, stderr = dry_run("basic", OUTPUT_DIR=tmp_path / "run", NCCL_SOCKET_IFNAME="lo",
                                       NPROC_PER_NODE=2)
    assert "GLOO_SOCKET_IFNAME" not in stderr  # one node: gloo's default works


def test_max_restarts_uses_torchrun_even_for_one_process_and_resumes(tmp_path):
    exports, command, stderr = dry_run("basic", "--lr", "1e-3", OUTPUT_DIR=tmp_path / "run", MAX_RESTARTS=2)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert value_after(command, "--max-restarts") == "2" and value_after(command, "--nproc_per_node") == "1"
    # a restart must not read the first attempt's store: c10d rendezvous, a store per attempt
    assert value_after(command, "--rdzv_backend") == "c10d"
    assert value_after(command, "--rdzv_endpoint").startswith("127.0.0.1:")
    assert exports["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert command[-4:] == ["--resume", "auto", "--lr", "1e-3"]  # before the user's flags, which win


def test_two_gloo_ranks_on_this_cpu(tmp_path):
    """NPROC_PER_NODE=2 bash run_nccl_optimized.sh basic --max_steps 20, on the demo corpus."""
    out = tmp_path / "run"
    r = launch("basic", *TINY, *QUICK, "--max_steps", "20", timeout=240, OUTPUT_DIR=out, NPROC_PER_NODE=2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "torch.distributed.run --nproc_per_node 2" in r.stderr
    assert "process group up: gloo, world size 2" in r.stderr
    assert events(out, "stop")[-1]["step"] == 20


def test_max_restarts_restarts_a_killed_rank_and_resumes_from_the_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed at step 12; torchrun restarts both ranks, which resume from step 10 and finish."""
    out = tmp_path / "run"
    start = time.monotonic()
    r = launch("basic", *TINY, *QUICK, "--max_steps", "20", "--save_every", "5", "--sync_check_every", "2",
               "--nccl_timeout", "60", "--sync_timeout", "30", timeout=280, OUTPUT_DIR=out, NPROC_PER_NODE=2,
               MAX_RESTARTS=1, RVQ_FAULT="kill:rank=1:step=12")
    seconds = time.monotonic() - start
    assert r.returncode == 0, r.stderr[-6000:]
    assert re.search(r"exitcode\s*: -9|exitcode: -9", r.stderr), "rank 1 was not killed"
    assert re.search(r"resumed from \S+step_00000010\.pt at step 10", r.stderr), r.stderr[-6000:]
    assert [e["step"] for e in events(out, "checkpoint")] == [5, 10, 15, 20]
    assert events(out, "stop")[-1]["step"] == 20
    print(f"kill, restart and resume took {seconds:.1f} s")


@pytest.mark.timeout(240)
def test_a_stop_while_the_ranks_import_stops_them_before_their_first_step_and_nothing_restarts(tmp_path):
    """SIGTERM to the launcher while torchrun's ranks import torch (seconds each): it reaches them once they catch
    it, they stop before their first step, and every process exits 0 (no restart under MAX_RESTARTS)."""
    from tools.launch import child_processes

    out = tmp_path / "run"
    log = tmp_path / "launch.log"
    code = signal_while_importing(  # the launcher's children: torchrun; theirs: the ranks
        ["bash", REPO / "run_nccl_optimized.sh", "basic", *TINY, *QUICK, "--max_steps", "20"], signal.SIGTERM,
        log=log, env=launch_env(OUTPUT_DIR=out, NPROC_PER_NODE=2, MAX_RESTARTS=1),
        watched=lambda pid: [rank for agent in child_processes(pid) for rank in child_processes(agent)])
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "SIGTERM: passed to this node's ranks" in text and "will restart worker group" not in text
    assert "stopped before the first step (signal on rank(s) [" in text
    stops = events(out, "stop")
    assert len(stops) == 1 and stops[0]["step"] == 0 and stops[0]["reason"].endswith("before the first step")
    assert not events(out, "train") and not list((out / "checkpoints").iterdir())


@pytest.mark.timeout(120)
def test_one_process_a_stop_before_the_exec_reaches_the_trainer(tmp_path):
    """The launcher caught a stop before it became the trainer: the trainer gets it and stops before its first
    step (exit 0), rather than lose it or die of it."""
    out = tmp_path / "run"
    script = ("import os, signal, sys\n"
              "from tools.launch import StopRelay\n"
              "relay = StopRelay(torchrun=False)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              f"relay.exec_trainer([sys.executable, {str(TRAINER)!r}, *{[*TINY, *QUICK, '--output_dir', str(out)]!r}],"
              " dict(os.environ))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env(),
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SIGTERM: passed to the trainer as it starts" in r.stderr
    assert "stopped before the first step (signal SIGTERM)" in r.stderr
    assert [e["reason"] for e in events(out, "stop")] == ["signal SIGTERM before the first step"]


def test_a_rank_aborted_by_signal_6_is_reported_as_a_distributed_failure(tmp_path):
    """Rank 1 ends by SIGABRT at step 4, as NCCL's watchdog ends a rank whose collective timed out: the launcher
    reads torchrun's summary, names the rank and the flight-recorder dumps, and exits 3."""
    out = tmp_path / "run"
    r = launch("basic", *TINY, *QUICK, "--max_steps", "20", "--sync_timeout", "30", timeout=240, OUTPUT_DIR=out,
               NPROC_PER_NODE=2, RVQ_FAULT="kill:rank=1:step=4:sig=ABRT")
    assert r.returncode == 3, r.stderr[-4000:]
    assert re.search(r"exitcode\s*: -6", r.stderr), r.stderr[-4000:]  # torchrun's own summary passed through
    assert "rank(s) [1] ended by signal 6 (SIGABRT)" in r.stderr
    assert f"{out}/nccl_traces/rank_<rank>" in r.stderr and "fr_trace" in r.stderr


def test_a_stuck_rank_named_by_the_watchdog_ends_the_launcher_with_exit_3(tmp_path):
    """Rank 1's main thread sleeps for good at step 4: every rank names it and exits 3, and so does the launcher
    (torchrun alone exits 1), so that a requeue script can tell a distributed failure from a rank's own error."""
    out = tmp_path / "run"
    r = launch("basic", *TINY, *QUICK, "--max_steps", "20", "--sync_timeout", "10", timeout=240, OUTPUT_DIR=out,
               NPROC_PER_NODE=2, RVQ_FAULT="stall:rank=1:step=4")
    assert r.returncode == 3, r.stderr[-4000:]
    assert re.search(r"exitcode\s*: 3", r.stderr), r.stderr[-4000:]  # torchrun's own summary passed through
    assert "stuck" in r.stderr and "exited 3: a distributed failure" in r.stderr


def test_the_launcher_reads_only_signal_6_in_torchruns_summary():
    from tools.launch import aborted_ranks

    summary = (b"Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-23_13:50:01\n"
               b"  host      : node7\n  rank      : 12 (local_rank: 4)\n  exitcode  : -6 (pid: 4242)\n"
               b"  error_file: <N/A>\n  traceback : Signal 6 (SIGABRT) received by PID 4242\n"
               b"Failures:\n[1]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : -9 (pid: 77)\n")
    assert aborted_ranks(summary) == [12]
    assert aborted_ranks(b"rank      : 3 (local_rank: 3)\n  exitcode  : 1 (pid: 5)\n") == []


def test_the_launcher_exits_3_when_the_failed_ranks_named_a_distributed_failure():
    from tools.launch import distributed_ranks

    summary = (b"Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 12)\n"
               b"Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
               b"  exitcode  : 3 (pid: 11)\n")
    assert distributed_ranks(summary) == [0]  # rank 1 stuck (SIGSTOP), ended by torchrun after rank 0 named it
    assert distributed_ranks(summary.replace(b"-15 (pid: 12)", b"3 (pid: 12)")) == [0, 1]
    assert distributed_ranks(summary.replace(b"-15 (pid: 12)", b"1 (pid: 12)")) == []  # a rank's own error: 1
    assert distributed_ranks(summary.replace(b"3 (pid: 11)", b"1 (pid: 11)")) == []


def test_the_launcher_exits_2_when_every_failed_rank_exited_2():
    from tools.launch import bad_input_ranks

    summary = (b"Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
               b"  exitcode  : 2 (pid: 11)\nFailures:\n[1]:\n  rank      : 1 (local_rank: 1)\n"
               b"  exitcode  : 2 (pid: 12)\n")
    assert bad_input_ranks(summary) == [0, 1]
    assert bad_input_ranks(summary.replace(b"2 (pid: 12)", b"1 (pid: 12)")) == []  # one rank's own error: not bad input
    assert bad_input_ranks(b"") == []


def test_bad_input_on_two_ranks_exits_2_naming_it(tmp_path):
    """Ranks that exit 2 (a feature file of another dim) make the launcher exit 2, its last line saying why."""
    data = tmp_path / "data"
    for split, dims in (("train", (16, 16, 16, 8)), ("valid", (16, 16))):
        (data / split).mkdir(parents=True)
        for i, dim in enumerate(dims):
            np.save(data / split / f"u{i}.npy", np.ones((200, dim), np.float32))
    r = launch("basic", *TINY, *QUICK, "--max_steps", "2", "--data_dir", data, timeout=120,
               OUTPUT_DIR=tmp_path / "run", NPROC_PER_NODE=2)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "dims differ" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("[run_nccl_optimized] rank(s) [0, 1] exited 2: bad input")


def test_single_process_fallback_command(tmp_path):
    """One process without a launcher, on the demo corpus: the default codec, several segment lengths (the
    end-of-schedule refit, a large k-means sample and a large eval, tested elsewhere, left out: the final eval's
    beam search on 8 levels of 1024 codes takes seconds)."""
    out = tmp_path / "run"
    r = run_trainer(["--batch_size", "16", "--multi_length_training", "--max_steps", "4", "--output_dir", out,
                     "--refit_iters", "0", "--kmeans_init_frames", "2048", "--eval_frames", "512"], timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DEMO corpus" in r.stderr
    assert events(out, "stop")[-1]["step"] == 4
    assert {e["segment_length"] for e in events(out, "train")} <= {64, 128, 256, 512}


@pytest.mark.timeout(240)
def test_sigterm_to_every_process_at_once_ends_the_launcher_as_any_checkpointed_stop(tmp_path):
    """scancel (or a preemption) signals the launcher, torchrun and the ranks at one instant: the ranks stop at one
    step with a checkpoint, and the launcher exits 0, the code of any stop with a checkpoint, which a requeue
    script reads (docs/launching.md), not torchrun's 1."""
    from tools.launch import child_processes

    out, log = tmp_path / "run", tmp_path / "launch.log"
    with open(log, "w") as sink:
        # --compile off: a run this long would compile its step on a CPU (--compile auto); a stop in a compile is
        # tests/test_stops.py's
        launcher = subprocess.Popen(["bash", str(REPO / "run_nccl_optimized.sh"), "basic", *TINY, *QUICK,
                                     "--max_steps", "100000", "--save_every", "100000", "--compile", "off"],
                                    stdout=sink, stderr=subprocess.STDOUT,
                                    env=launch_env(OUTPUT_DIR=out, NPROC_PER_NODE=2), cwd=REPO)
    try:
        deadline = time.monotonic() + 150
        while not (out / "metrics.jsonl").is_file() or not events(out, "train"):  # both ranks are in the loop
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        agents = child_processes(launcher.pid)
        every = [launcher.pid, *agents, *(rank for agent in agents for rank in child_processes(agent))]
        assert len(every) == 4, every  # the launcher, torchrun and its two ranks
        for pid in every:
            os.kill(pid, signal.SIGTERM)
        code = launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text[-4000:]
    stop = events(out, "stop")[-1]
    assert stop["reason"].startswith("signal") and events(out, "checkpoint")[-1]["step"] == stop["step"]
    assert "SignalException" not in text  # torchrun did not end the ranks itself
