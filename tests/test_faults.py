"""Every fault on 2 gloo ranks: each run ends within its bound, with the right exit code, message and files."""
import re
import shutil

import numpy as np
import pytest
import torch

from tests.helpers import (EXIT_PROBE, Ranks, TINY, events, newest_checkpoint, run_flags, run_trainer,
                           trainer_in_process, write_dump, write_fairseq)

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

SYNC_TIMEOUT = 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("data"), train=61, valid=7, seed=3)


def flags(data, out, *extra):
    return run_flags(data, out, "--sync_check_every", "4", "--sync_timeout", SYNC_TIMEOUT, "--nccl_timeout", "600",
                     "--eval_every", "8", *extra)


@pytest.fixture
def ranks(tmp_path):
    started = []

    def start(*args, **kw):
        r = Ranks(*args, **{"log_dir": tmp_path / f"ranks{len(started)}", **kw})
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()


def assert_same_weights(a, b):
    assert a["step"] == b["step"]
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)


def test_killed_rank_is_named_and_resume_loses_at_most_save_every(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 30, "--save_every", 4), extra_env={"RVQ_FAULT": "kill:rank=1:step=10"})
    codes = job.wait(timeout=SYNC_TIMEOUT + 90)
    assert codes[1] == -9
    assert codes[0] not in (0, None), job.output(0)
    assert job.ended[0] - job.ended[1] <= SYNC_TIMEOUT + 30
    assert "rank(s) [1] lost" in job.output(0)

    again = ranks(flags(data, out, "--max_steps", 30, "--save_every", 4))
    assert again.wait(timeout=200) == [0, 0], again.output(0)
    assert "resumed from" in again.output(0) and "at step 8" in again.output(0)  # killed during step 11
    assert events(out, "stop")[-1]["step"] == 30


@pytest.fixture(scope="module")
def checkpointed(data, tmp_path_factory):
    """An output dir holding checkpoints at steps 4 and 8 (a short single-process run); tests copy it to change it."""
    out = tmp_path_factory.mktemp("checkpointed")
    r = run_trainer(flags(data, out, "--max_steps", 8, "--save_every", 4), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_read_rank_0s_checkpoint_ends_every_rank_with_exit_2(tmp_path, data, checkpointed, ranks):
    """Two nodes with different --output_dirs: rank 0 resumes from its step 8, which rank 1 does not have."""
    elsewhere = tmp_path / "elsewhere"
    job = ranks(lambda rank: flags(data, checkpointed if rank == 0 else elsewhere, "--max_steps", 12))
    assert job.wait(timeout=60) == [2, 2], job.output(0) + job.output(1)
    for r in (0, 1):
        assert (f"rank 1 cannot read checkpoint {elsewhere}/checkpoints/step_00000008.pt chosen by rank 0 "
                f"({checkpointed}/checkpoints/step_00000008.pt, step 8): ") in job.output(r), job.output(r)
        assert "No such file" in job.output(r)
        assert "--output_dir must be on a filesystem every node sees" in job.output(r)
    assert not elsewhere.exists()


@pytest.mark.timeout(120)
def test_checkpoints_only_another_rank_sees_are_ignored_with_a_warning(tmp_path, data, checkpointed, ranks):
    """Rank 0 decides: with none in its --output_dir every rank starts at step 0, and rank 1 says what it ignores."""
    fresh = tmp_path / "fresh"
    job = ranks(lambda rank: flags(data, fresh if rank == 0 else checkpointed, "--max_steps", 2))
    assert job.wait(timeout=90) == [0, 0], job.output(0) + job.output(1)
    assert (f"rank 1: rank 0 found no checkpoint to resume from, so every rank starts at step 0; the 2 checkpoint(s) "
            f"in {checkpointed}/checkpoints (newest step_00000008.pt) are ignored") in job.output(1)
    assert "resumed from" not in job.output(0)
    assert [e["step"] for e in events(fresh, "train")] == [1, 2]


def test_a_rank_that_crashes_in_native_code_leaves_its_threads_stacks_and_is_named_lost(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 30), extra_env={"RVQ_FAULT": "kill:rank=1:step=3:sig=SEGV"})
    codes = job.wait(timeout=SYNC_TIMEOUT + 90)
    assert codes[1] == -11 and codes[0] == 3, job.output(0) + job.output(1)
    assert "rank(s) [1] lost" in job.output(0)
    crash = job.output(1)[job.output(1).index("Fatal Python error: Segmentation fault"):]
    assert re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n\s+File \".*training/faults\.py\", "
                     r"line \d+ in kill_this_process\n\s+File \".*training/faults\.py\", line \d+ in before_step",
                     crash), crash
    assert re.search(r"\nThread 0x[0-9a-f]+ \(most recent call first\):\n(\s+File .*\n)*?"
                     r"\s+File \".*training/watchdog\.py\", line \d+ in _run\n", crash), crash  # another thread's


@pytest.mark.timeout(120)
def test_rank_0s_fallback_from_a_truncated_checkpoint_is_what_every_rank_loads(tmp_path, data, checkpointed, ranks):
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    newest = out / "checkpoints" / "step_00000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    job = ranks(flags(data, out, "--max_steps", 10))
    assert job.wait(timeout=90) == [0, 0], job.output(0) + job.output(1)  # the sync check at step 8 compares steps
    assert "step_00000008.pt is unreadable" in job.output(0) and "unreadable" not in job.output(1)
    assert "moved aside to step_00000008.pt.unreadable" in job.output(0)
    assert re.search(r"resumed from \S+/step_00000004\.pt at step 4", job.output(0))
    assert events(out, "stop")[-1]["step"] == 10


@pytest.mark.timeout(120)
def test_when_every_checkpoint_is_unreadable_rank_0_moves_them_aside_before_any_rank_looks(tmp_path, data,
                                                                                            checkpointed, ranks):
    """Rank 0 alone renames them, before it sends its choice: rank 1, on the same filesystem, sees none to ignore."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    for step in (4, 8):
        (out / "checkpoints" / f"step_{step:08d}.pt").write_bytes(b"")
    job = ranks(flags(data, out, "--max_steps", 2))
    assert job.wait(timeout=90) == [0, 0], job.output(0) + job.output(1)
    assert job.output(0).count("is unreadable (empty file); moved aside") == 2
    assert "is unreadable" not in job.output(1) and "are ignored" not in job.output(1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000004.pt.unreadable", "step_00000008.pt.unreadable"]
    assert [e["step"] for e in events(out, "train")][-2:] == [1, 2]


@pytest.mark.parametrize("stopped, fault, named", [
    # rank 1 stopped while rank 0 blocks in the gradient all-reduce: its heartbeat stops
    (1, "hang:rank=1:step=6:at=backward", r"stopping at step 6 \(\w+\): rank\(s\) \[1\] silent: no heartbeat"),
    # rank 0 stopped, and with it the rendezvous store it hosts (srun, hand-started ranks): rank 1's store
    # requests go unanswered (one can block for good); the collective timeout is 600 s
    (0, "hang:rank=0:step=10", r"the rendezvous store at 127\.0\.0\.1:\d+, hosted by rank 0, has not answered for \d+s"),
])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, data, ranks, stopped, fault, named):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 60), extra_env={"RVQ_FAULT": fault})
    other = 1 - stopped
    codes = job.wait(timeout=SYNC_TIMEOUT + 90, ranks=[other])
    assert codes[stopped] is None and stopped in job.stopped  # stopped, not dead
    assert codes[other] == 3, job.output(other)
    assert job.ended[other] - job.stopped[stopped] <= SYNC_TIMEOUT + 30
    assert re.search(named, job.output(other)), job.output(other)


def test_perturbed_codebook_is_caught_at_the_next_sync_check(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 30), extra_env={"RVQ_FAULT": "desync:rank=1:step=5", **EXIT_PROBE})
    assert job.wait(timeout=120) == [3, 3], job.output(0) + job.output(1)
    for r in (0, 1):
        assert "sync check at step 8: the codebooks of rank(s) 1 differ from rank 0's" in job.output(r)
        # every rank raised it together: the groups went down, and their threads ended before the interpreter's
        # exit (left to it, a rank once aborted there as its peer exited first)
        assert "exit probe: 1 thread(s)" in job.output(r), job.output(r)[-2000:]


def test_sigterm_to_one_rank_stops_both_at_one_step_and_resumes_exactly(tmp_path, data, ranks):
    straight = tmp_path / "straight"
    assert ranks(flags(data, straight, "--max_steps", 16)).wait(timeout=200) == [0, 0]

    out = tmp_path / "split"
    job = ranks(flags(data, out, "--max_steps", 16), extra_env={"RVQ_FAULT": "signal:rank=1:step=5:sig=TERM"})
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert "SIGTERM received" in job.output(1) and "SIGTERM" not in job.output(0)
    stop = events(out, "stop")[-1]
    assert stop["step"] == 8 and "signal on rank(s) [1]" in stop["reason"]
    assert [e["step"] for e in events(out, "checkpoint")] == [8]
    assert not events(out, "refit")  # a stop on request skips the refit: the job may have seconds left

    again = ranks(flags(data, out, "--max_steps", 16))
    assert again.wait(timeout=200) == [0, 0], again.output(0)
    assert_same_weights(newest_checkpoint(straight), newest_checkpoint(out))


@pytest.mark.timeout(180)
def test_sigterm_to_one_rank_of_slow_steps_stops_both_within_seconds(tmp_path, data, ranks):
    """Steps of over a second, and 50 of them between the step-count sync checks (and no eval to agree on the
    stop): the checks come by time too, about every STOP_CHECK_SECONDS, so both ranks stop a step or two after
    the signal, not at step 50, well inside the 30 s a scheduler allows before SIGKILL."""
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 60, "--sync_check_every", 50, "--eval_every", 100),
                extra_env={"RVQ_FAULT": "slow_steps:seconds=1,signal:rank=1:step=5:sig=TERM"})
    sent = job.wait_for(1, "SIGTERM received", timeout=120)
    codes = job.wait(timeout=90)
    assert codes == [0, 0], job.output(0) + job.output(1)
    took = max(job.ended.values()) - sent
    stop = events(out, "stop")[-1]
    print(f"SIGTERM to rank 1 at step {stop['step']} of 1 s steps: both ranks exited {took:.1f} s after it")
    assert 5 <= stop["step"] <= 8 and "signal on rank(s) [1]" in stop["reason"], stop
    assert [e["step"] for e in events(out, "checkpoint")] == [stop["step"]]
    assert took < 20, (took, job.output(0)[-3000:])


def test_eval_error_on_one_rank_is_skipped_by_all_and_training_goes_on(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 16), extra_env={"RVQ_FAULT": "eval_error:rank=1"})
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert [(e["step"], e["ranks"]) for e in events(out, "eval_failed")] == [(8, [1])]
    assert [e["step"] for e in events(out, "eval")] == [16]
    assert events(out, "stop")[-1]["step"] == 16


def test_nan_loss_on_one_rank_is_skipped_on_both(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 12), extra_env={"RVQ_FAULT": "nan:rank=1:step=5"})
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert [e["step"] for e in events(out, "skipped_step")] == [6]
    assert "update skipped on every rank" in job.output(1)
    assert events(out, "train")[-1]["bad_steps"] == 1
    assert events(out, "stop")[-1]["step"] == 12  # the sync checks at 8 and 12 found equal codebooks


def test_a_nan_frame_on_one_rank_is_dropped_there_and_the_ranks_stay_in_sync(tmp_path, ranks):
    data = tmp_path / "data"
    utts = write_fairseq(data, "train", [40] * 8, seed=5)
    arr = np.concatenate(utts)
    arr[3 * 40 + 20, 0] = np.nan  # utterance 3: rank 1's shard; every 32-frame crop of it covers frame 20
    np.save(data / "train_0_1.npy", arr)
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 12, "--prefetch"))
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert job.output(1).count("train_0_1.npy utterance 3 (rows 120-160)") == 1
    train = events(out, "train")
    assert train[-1]["bad_utterances"] == 1 and train[-1]["dropped_crops"] >= 1
    assert events(out, "stop")[-1]["step"] == 12  # the sync checks at 4, 8 and 12 found equal codebooks


def test_too_many_bad_steps_checkpoint_and_exit_1(tmp_path, data, ranks):
    out = tmp_path / "run"
    faults = ",".join(f"nan:step={s}" for s in range(3, 7))
    job = ranks(flags(data, out, "--max_steps", 20, "--max_bad_steps", 3), extra_env={"RVQ_FAULT": faults})
    assert job.wait(timeout=200) == [1, 1], job.output(0) + job.output(1)
    assert "4 non-finite steps in a row" in job.output(0)
    assert [e["step"] for e in events(out, "checkpoint")] == [7]


@pytest.mark.parametrize("style", ["slurm", "accelerate"])
def test_other_launchers_environments(tmp_path, data, ranks, style):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 8, "--grad_accum", 2), style=style, extra_env=EXIT_PROBE)
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert "world size 2" in job.output(0) and "in 2 micro-batch(es)" in job.output(0)
    for r in (0, 1):  # the groups and their threads ended before the interpreter's exit
        assert "exit probe: 1 thread(s)" in job.output(r), job.output(r)[-2000:]
    assert events(out, "stop")[-1]["step"] == 8


@pytest.mark.parametrize("stuck", [1, 0])  # rank 0 hosts the rendezvous store
def test_rank_whose_main_thread_stalls_is_named_by_every_rank(tmp_path, data, ranks, stuck):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 60), extra_env={"RVQ_FAULT": f"stall:rank={stuck}:step=30"},
                log_dir=tmp_path / "logs")
    stalled = job.wait_for(stuck, "stalls in data at step 30", timeout=200)
    assert job.wait(timeout=SYNC_TIMEOUT + 60) == [3, 3], job.output(0) + job.output(1)
    assert max(job.ended.values()) - stalled <= SYNC_TIMEOUT + 30
    other = 1 - stuck
    for r in (0, 1):
        assert f"rank(s) [{stuck}] stuck: rank {stuck} in data at step 30 for" in job.output(r), job.output(r)
        assert "in stall (allowance 10s). The others wait: rank %d in " % other in job.output(r)
    assert re.search(r'Thread 0x[0-9a-f]+ \(most recent call first\):\n  File ".*faults.py", line \d+ in stall',
                     job.output(stuck))  # every thread's stack, its main thread's in the fault's sleep
    assert "Thread 0x" not in job.output(other)


def test_stall_shorter_than_sync_timeout_is_no_alarm(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 20),
                extra_env={"RVQ_FAULT": f"stall:rank=1:step=10:seconds={SYNC_TIMEOUT // 2}"})
    assert job.wait(timeout=200) == [0, 0], job.output(0) + job.output(1)
    assert "stalls in data at step 10 for 5s" in job.output(1)
    assert events(out, "stop")[-1]["step"] == 20


@pytest.mark.long
def test_checkpoint_writes_longer_than_the_timeouts_are_no_alarm(tmp_path, data, ranks):
    """Each write outlasts --sync_timeout and the process groups' own timeout but not --slow_phase_timeout: the
    other rank waits for it inside the save, under the slow-phase timeout, not in the next collective (step 8)
    nor at the final barrier (step 16, the last save)."""
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 16, "--save_every", 8, "--nccl_timeout", 12,
                      "--slow_phase_timeout", 120),
                extra_env={"RVQ_FAULT": "slow_save:seconds=16:step=8,slow_save:seconds=16:step=16"})
    assert job.wait(timeout=240) == [0, 0], job.output(0) + job.output(1)
    assert job.output(0).count("this checkpoint write takes 16s longer") == 2
    assert [e["step"] for e in events(out, "checkpoint")] == [8, 16]


@pytest.mark.parametrize("phase", ["train", "sync check"])  # rank 0 waits in that phase's collective
def test_a_rank_stuck_in_the_phase_where_the_other_waits_in_a_collective_is_named(tmp_path, data, ranks, phase):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 60), extra_env={"RVQ_FAULT": f"stall:rank=1:step=12:at={phase}"})
    assert job.wait(timeout=SYNC_TIMEOUT + 150) == [3, 3], job.output(0) + job.output(1)
    for r in (0, 1):
        assert f"rank(s) [1] stuck: rank 1 in {phase} at step 12 for" in job.output(r), job.output(r)
        assert "in stall (allowance 10s). The others wait: rank 0 in " in job.output(r), job.output(r)
    assert "Thread 0x" in job.output(1) and "Thread 0x" not in job.output(0)  # the stuck rank's stacks only


@pytest.mark.parametrize("phase, step", [("forward", 0),  # a slow first step
                                         ("eval", 8),  # a long eval
                                         ("refit", 16)])  # a long codebook refit, after the last step
def test_slow_phase_longer_than_sync_timeout_is_no_alarm(tmp_path, data, ranks, phase, step):
    out = tmp_path / "run"
    fault = f"stall:rank=1:step={step}:at={phase}:seconds={SYNC_TIMEOUT + 5}"
    job = ranks(flags(data, out, "--max_steps", 16), extra_env={"RVQ_FAULT": fault})
    assert job.wait(timeout=240) == [0, 0], job.output(0) + job.output(1)
    assert f"stalls in {phase} at step {step} for 15s" in job.output(1)
    assert [e["step"] for e in events(out, "eval")] == [8, 16]
    assert [e["step"] for e in events(out, "refit")] == [16]


def test_rank_in_a_collective_the_others_never_join_is_named_as_a_desync(tmp_path, data, ranks):
    out = tmp_path / "run"
    job = ranks(flags(data, out, "--max_steps", 60), extra_env={"RVQ_FAULT": "extra_collective:rank=1:step=30"},
                log_dir=tmp_path / "logs")
    entered = job.wait_for(1, "enters an all-reduce the other ranks never join", timeout=200)
    assert job.wait(timeout=SYNC_TIMEOUT + 60) == [3, 3], job.output(0) + job.output(1)
    assert max(job.ended.values()) - entered <= SYNC_TIMEOUT + 30
    for r in (0, 1):
        assert "ranks in different collectives (a desync), rank(s) [1] stuck longest: " in job.output(r), job.output(r)
        assert re.search(r"rank 0 in \w+ at step 30 for \d+s, at \S+ in all_reduce", job.output(r))
        assert re.search(r"rank 1 in data at step 30 for \d+s, at \S+ in all_reduce, called from "
                         r"training/faults.py:\d+ in on_phase", job.output(r))


def test_an_eval_that_fails_after_the_sums_are_reduced_is_skipped_and_training_goes_on(tmp_path):
    """Every held-out window has a NaN frame, so none is evaluated: the metrics of the reduced sums fail."""
    d = tmp_path / "data"
    write_fairseq(d, "train", np.random.default_rng(0).integers(40, 200, size=20).tolist())
    utts = write_fairseq(d, "valid", [64, 64], seed=1)
    valid = np.concatenate(utts)
    valid[::16] = np.nan
    np.save(d / "valid_0_1.npy", valid)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", d, "--output_dir", out, *TINY, "--max_steps", "4", "--eval_every", "2",
                            "--refit_iters", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval at step 2 failed on every rank" in r.stderr and "Traceback" not in r.stderr
    assert [(e["step"], e["ranks"]) for e in events(out, "eval_failed")] == [(2, [0]), (4, [0])]
    assert [e["step"] for e in events(out, "checkpoint")] == [4]
    assert events(out, "stop")[-1]["reason"] == "max_steps"
