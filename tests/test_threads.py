"""The CPU thread count: the flag, then OMP_NUM_THREADS, then the cores the run can get (affinity, cgroup quota,
other processes' load), from fake inputs; the environment is always passed, never the test process's own."""
import pytest
import torch

from tests.helpers import QUICK, TINY, newest_checkpoint, trainer_in_process
from training.threads import (busy_cores, choose_threads, cpu_times, decide, omp_threads, parse_cfs, parse_cpu_max,
                              quota_cores)

STAT_HEADER = "cpu  100 0 100 800 0 0 0 0 0 0\n"


def stat(*cpus: tuple[int, int, int]) -> str:
    """A /proc/stat text: (user, idle, steal) jiffies per CPU."""
    lines = [f"cpu{i} {user} 0 0 {idle} 0 0 0 {steal} 0 0" for i, (user, idle, steal) in enumerate(cpus)]
    return STAT_HEADER + "\n".join(lines) + "\nintr 1 2 3\nctxt 99\nbtime 1\n"


@pytest.mark.parametrize("text, cores", [("150000 100000", 1.5), ("max 100000", None), ("400000 100000\n", 4.0)])
def test_cgroup_v2_cpu_max(text, cores):
    assert parse_cpu_max(text) == cores


@pytest.mark.parametrize("quota, period, cores", [("-1", "100000", None), ("50000", "100000", 0.5),
                                                  ("300000", "100000", 3.0)])
def test_cgroup_v1_cfs_quota(quota, period, cores):
    assert parse_cfs(quota, period) == cores


def test_quota_read_from_a_v2_then_a_v1_hierarchy(tmp_path):
    assert quota_cores(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cores(tmp_path) == 2.0
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # v2 wins where both are there
    assert quota_cores(tmp_path) == 1.0


def test_busy_cores_counts_only_this_process_cpus_and_steal_as_busy():
    before = stat((0, 0, 0), (0, 0, 0), (0, 0, 0))
    after = stat((100, 0, 0), (0, 100, 0), (0, 50, 50))  # cpu0 busy, cpu1 idle, cpu2 half stolen
    assert busy_cores(before, after, None) == pytest.approx(1.5)
    assert busy_cores(before, after, {1}) == pytest.approx(0.0)
    assert busy_cores(before, after, {0, 2}) == pytest.approx(1.5)
    assert cpu_times(after, {0})[2] == 1
    assert busy_cores(before, before, None) is None  # no time passed: nothing known


@pytest.mark.parametrize("environ, count", [({"OMP_NUM_THREADS": "3"}, 3), ({"OMP_NUM_THREADS": "4,2"}, 4),
                                            ({"OMP_NUM_THREADS": ""}, None), ({"OMP_NUM_THREADS": "x"}, None),
                                            ({"OMP_NUM_THREADS": "0"}, None), ({}, None)])
def test_omp_num_threads(environ, count):
    assert omp_threads(environ) == count


def test_the_flag_wins_over_the_environment_which_wins_over_the_machine():
    machine = {"cpus": 8, "quota": None, "busy": 0.0}
    assert decide(flag=2, environ={"OMP_NUM_THREADS": "5"}, **machine).threads == 2
    choice = decide(flag=None, environ={"OMP_NUM_THREADS": "5"}, **machine)
    assert (choice.threads, choice.why) == (5, "OMP_NUM_THREADS=5 from the environment")
    assert decide(flag=None, environ={}, **machine).threads == 8


@pytest.mark.parametrize("cpus, quota, busy, threads", [
    (2, None, 0.0, 2),    # a quiet machine: every core
    (2, None, 0.1, 2),    # noise
    (2, None, 2.0, 1),    # beside a 2-thread job: one thread, never zero
    (2, None, 1.0, 1),    # one core taken
    (2, None, 0.5, 1),    # half a core taken: a second thread would stall every barrier
    (8, None, 3.0, 5),
    (8, 2.0, 0.0, 2),     # the cgroup quota caps the affinity
    (8, 1.5, 0.0, 2),     # a fractional quota is rounded up
    (8, 0.5, 0.0, 1),
    (64, 4.0, 40.0, 4),   # a busy host, but our quota's worth of cores is free
    (4, None, None, 4),   # load unknown: the cores
])
def test_the_machine_decides_when_nobody_else_does(cpus, quota, busy, threads):
    choice = decide(flag=None, environ={}, cpus=cpus, quota=quota, busy=busy)
    assert choice.threads == threads, choice.why


def test_ranks_on_one_node_share_the_cores_and_torch_default_is_the_ceiling():
    assert decide(flag=None, environ={}, cpus=8, quota=None, busy=None, local_ranks=4).threads == 2
    assert decide(flag=None, environ={}, cpus=2, quota=None, busy=None, local_ranks=4).threads == 1
    choice = decide(flag=None, environ={}, cpus=16, quota=None, busy=0.0, default=8)  # 8 physical cores, SMT
    assert choice.threads == 8 and "torch's default of 8" in choice.why


def test_the_reason_names_what_decided(tmp_path):
    why = decide(flag=None, environ={}, cpus=4, quota=2.0, busy=1.5).why
    assert "4 CPU(s)" in why and "quota of 2 cores" in why and "1.5 of them busy" in why
    assert decide(flag=3, environ={}, cpus=4, quota=None, busy=None).why == "--threads 3"


def test_choose_threads_samples_the_given_stat_file_and_cgroup(tmp_path, monkeypatch):
    """A /proc/stat that says every CPU is busy, a cgroup v2 quota of 1 core: the choice reads the files it is
    given, with the environment it is given (no OMP_NUM_THREADS), not the test process's."""
    monkeypatch.setattr("training.threads.affinity_cpus", lambda: {0, 1})
    fake = tmp_path / "stat"
    fake.write_text(stat((0, 0, 0), (0, 0, 0)))
    monkeypatch.setattr("training.threads.time.sleep", lambda s: fake.write_text(stat((100, 0, 0), (100, 0, 0))))
    (tmp_path / "cg").mkdir()
    busy = choose_threads(None, {}, cgroup=tmp_path / "cg", stat=fake)
    assert busy.threads == 1 and "2.0 of them busy" in busy.why
    (tmp_path / "cg" / "cpu.max").write_text("max 100000")
    quiet = choose_threads(None, {"OMP_NUM_THREADS": ""}, cgroup=tmp_path / "cg", stat=tmp_path / "no-stat")
    assert quiet.threads == 2 and "load unknown" in quiet.why
    assert choose_threads(None, {"OMP_NUM_THREADS": "1"}, stat=fake).threads == 1  # the environment: no sample
    assert choose_threads(None, {"LOCAL_WORLD_SIZE": "2"}, cgroup=tmp_path / "cg", stat=fake).threads == 1


def test_the_trainer_says_what_it_chose_and_why(tmp_path):
    """The flag is applied and logged; without it, OMP_NUM_THREADS (conftest sets 1) is."""
    before = torch.get_num_threads()
    try:
        quick = ["--device", "cpu", *TINY, *QUICK, "--refit_iters", "0", "--max_steps", "1"]
        r = trainer_in_process(["--output_dir", tmp_path / "a", *quick, "--threads", "2"])
        assert r.returncode == 0, r.stderr[-2000:]
        assert "threads: 2 (--threads 2)" in r.stderr
        r = trainer_in_process(["--output_dir", tmp_path / "b", *quick], extra_env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        assert "threads: 1 (OMP_NUM_THREADS=1 from the environment)" in r.stderr
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("environ, ranks, named", [
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}, 2,
     "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "4,1", "SLURM_NODEID": "1"}, 1,
     "SLURM_TASKS_PER_NODE"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}, 4, "SLURM_NTASKS_PER_NODE"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, 2, "SLURM_NTASKS over the nodes"),  # one node
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "LOCAL_WORLD_SIZE": "1"}, 1, "LOCAL_WORLD_SIZE"),  # torchrun's wins
])
def test_ranks_srun_started_share_the_nodes_cores_as_torchruns_do(environ, ranks, named, tmp_path, monkeypatch):
    """Without LOCAL_WORLD_SIZE, srun's tasks on this node share its cores, and none samples the load as if alone."""
    monkeypatch.setattr("training.threads.affinity_cpus", lambda: set(range(8)))
    fake = tmp_path / "stat"  # every CPU busy: a rank that sampled it would take one thread
    fake.write_text(stat(*[(0, 0, 0)] * 8))
    monkeypatch.setattr("training.threads.time.sleep", lambda s: fake.write_text(stat(*[(100, 0, 0)] * 8)))
    choice = choose_threads(None, environ, cgroup=tmp_path, stat=fake)
    if ranks > 1:
        assert choice.threads == 8 // ranks, choice.why
        assert f"shared by {ranks} ranks on this node ({named})" in choice.why and "busy" not in choice.why
    else:  # the node's only rank: the load it samples decides
        assert choice.threads == 1 and "8.0 of them busy" in choice.why, choice.why


def test_a_resumed_cpu_run_computes_with_its_runs_thread_count_unless_told_otherwise(tmp_path, small_data):
    """The count a run computed with is in its checkpoint; a resumed run takes it, not the machine's choice of the
    moment, unless --threads or OMP_NUM_THREADS says otherwise."""
    before = torch.get_num_threads()
    out = tmp_path / "run"
    flags = ["--data_dir", small_data, "--output_dir", out, "--device", "cpu", *TINY, *QUICK, "--refit_iters", "0"]
    try:
        r = trainer_in_process([*flags, "--threads", "2", "--max_steps", "1"])
        assert r.returncode == 0, r.stderr[-2000:]
        r = trainer_in_process([*flags, "--max_steps", "2"], extra_env={"OMP_NUM_THREADS": ""})
        assert r.returncode == 0, r.stderr[-2000:]
        assert "threads: 2 (the count the run it resumes computed with, from its checkpoint" in r.stderr
        assert newest_checkpoint(out)["threads"] == 2
    finally:
        torch.set_num_threads(before)
    machine = {"cpus": 8, "quota": None, "busy": 0.0}  # the flag and the environment still win over the record
    assert decide(flag=3, environ={"OMP_NUM_THREADS": "5"}, recorded=2, **machine).threads == 3
    assert decide(flag=None, environ={"OMP_NUM_THREADS": "5"}, recorded=2, **machine).threads == 5
    assert decide(flag=None, environ={}, recorded=2, **machine).threads == 2


@pytest.mark.timeout(150)
def test_the_cpu_commands_pick_their_threads_and_their_codes_do_not_depend_on_the_count(tmp_path):
    """tools.encode chooses its threads as the trainer does (the cores it can get; OMP_NUM_THREADS wins). A resumed
    shard may so compute with another count than its start: the codes must be the same bits at any count."""
    from tests.audio_helpers import codec_checkpoint
    from tests.helpers import env, run_python, write_fairseq

    data = tmp_path / "feats"
    write_fairseq(data, "train", [300, 700, 1200, 50], dim=32)
    codec = codec_checkpoint(tmp_path / "codec.pt", {}, 32, latent_dim=32, num_quantizers=4, codebook_size=64,
                             beam_size=4)
    codes = {}
    for threads in (None, "1", "3"):
        e = env(OMP_NUM_THREADS=threads or "")
        if threads is None:
            del e["OMP_NUM_THREADS"]
        out = tmp_path / f"codes_{threads}"
        r = run_python(["-m", "tools.encode", "--checkpoint", codec, "--data_dir", data, "--output_dir", out],
                       env=e, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        said = next(line for line in r.stderr.splitlines() if "threads: " in line)
        if threads is None:
            assert "CPU(s) in this process's affinity" in said, said
        else:
            assert f"threads: {threads} (OMP_NUM_THREADS={threads} from the environment)" in said, said
        codes[threads] = (out / "train_0_1.codes.npy").read_bytes()
    assert codes["1"] == codes["3"] == codes[None]
