"""--max_minutes (a clean stop with the final eval and checkpoint, agreed across ranks) and codebook health in evals."""
import time

import pytest

from tests.helpers import Ranks, TINY, events, newest_checkpoint, run_trainer, trainer_in_process, write_dump

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("data"), train=41, valid=6, seed=5)


def assert_stopped_on_time(out):
    stop = events(out, "stop")
    assert [s["reason"] for s in stop] == ["max_minutes"]
    last = stop[0]["step"]
    assert 0 < last < 100_000
    assert events(out, "eval")[-1]["step"] == last  # the final eval, at the stopping step
    refits = events(out, "refit")  # the codebook refit, before that eval, on every rank
    assert [r["step"] for r in refits] == [last] and len(refits[0]["residual_mse"]) == 2
    assert events(out, "checkpoint")[-1]["step"] == last
    assert (out / "checkpoints" / f"step_{last:08d}.pt").is_file()
    return last


def test_max_minutes_stops_cleanly_with_final_eval_and_checkpoint(tmp_path, data):
    out = tmp_path / "run"
    r = run_trainer(["--data_dir", data, "--output_dir", out, *TINY, "--max_steps", "100000", "--max_minutes", "0.05",
                     "--eval_every", "100000", "--save_every", "100000"], timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_stopped_on_time(out)
    assert "finished at step" in r.stderr and "max_minutes" in r.stderr


def test_max_minutes_alone_fits_the_whole_run_in_the_budget_and_finishes_the_decay(tmp_path, data):
    out = tmp_path / "run"
    budget_s = 20
    start = time.monotonic()
    r = run_trainer(["--data_dir", data, "--output_dir", out, *TINY, "--max_minutes", str(budget_s / 60),
                     "--kmeans_init_frames", "0", "--eval_every", "100000", "--save_every", "100000"], timeout=180)
    wall = time.monotonic() - start
    assert r.returncode == 0, r.stderr[-2000:]
    last = assert_stopped_on_time(out)
    assert last > 5  # trained, not stopped at once
    # start to exit within the budget: the refit, the final eval and the checkpoint were kept time for
    # (the margin: the interpreter's own start before the trainer's clock, and its exit)
    assert wall < budget_s + 5, (wall, r.stderr[-2000:])
    lrs = [e["lr"] for e in events(out, "train")]
    assert lrs[-1] < 0.2 * max(lrs)  # the decay ran to (near) its floor, 0.1 x --lr, as the time ran out
    assert "--max_minutes" in r.stderr and "refit and final eval took" in r.stderr


def test_max_minutes_on_two_ranks_stops_every_rank_at_the_same_step(tmp_path, data):
    out = tmp_path / "run"
    job = Ranks(["--data_dir", data, "--output_dir", out, *TINY, "--max_steps", "100000", "--max_minutes", "0.05",
                 "--eval_every", "100000", "--save_every", "100000", "--sync_check_every", "3",
                 "--sync_timeout", "20"], log_dir=tmp_path / "logs")
    try:
        codes = job.wait(timeout=200)
        assert codes == [0, 0], job.output(0)[-2000:] + job.output(1)[-2000:]
        last = assert_stopped_on_time(out)
        # decided from rank 0's clock, which the ranks share at a sync check (by step, or by time: on busy cores
        # the set-up alone can spend the 3-s budget, and the first check, at step 1, ends the run), or at the end
        # of the schedule that its time estimate set (a check too): the same step everywhere, else the refit's and
        # the final eval's collectives would not meet and the ranks would not exit 0
        assert last >= 1
        assert f"finished at step {last}: max_minutes" in job.output(0)
    finally:
        job.close()


def timed_in_process(monkeypatch, args):
    """The trainer's main() in this process, its --max_minutes counted from now (the module's import is earlier)."""
    import rvq_seamless_gpu_cache_nccl as trainer

    monkeypatch.setattr(trainer, "STARTED", time.monotonic())
    return trainer_in_process(args)


@pytest.mark.timeout(120)
def test_a_relaunched_time_budget_trains_no_more_unless_raised(tmp_path, data, monkeypatch):
    out = tmp_path / "run"
    flags = ["--data_dir", data, "--output_dir", out, *TINY, "--kmeans_init_frames", "0", "--eval_every", "100000",
             "--save_every", "100000"]
    r = timed_in_process(monkeypatch, [*flags, "--max_minutes", "0.05"])
    assert r.returncode == 0, r.stderr[-2000:]
    last = assert_stopped_on_time(out)
    assert newest_checkpoint(out)["time_spent"] == 3.0  # the whole budget: the clock ended the schedule
    # the same flags again (a requeue): nothing left to train, refit or evaluate
    r = timed_in_process(monkeypatch, [*flags, "--max_minutes", "0.05"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing is left to do" in r.stderr and f"finished at step {last}: max_minutes" in r.stderr
    assert "refit and final eval took" not in r.stderr
    assert [e["step"] for e in events(out, "stop")] == [last, last] and len(events(out, "refit")) == 1
    assert max(e["step"] for e in events(out, "train")) == last
    # a larger budget trains on for the minutes added
    r = timed_in_process(monkeypatch, [*flags, "--max_minutes", "0.1"])
    assert r.returncode == 0, r.stderr[-2000:]
    stop = events(out, "stop")[-1]
    assert stop["reason"] == "max_minutes" and stop["step"] > last
    assert [e["step"] for e in events(out, "refit")] == [last, stop["step"]]
    assert newest_checkpoint(out)["time_spent"] == 6.0


def stopped_in_its_refit(monkeypatch, flags):
    """A timed run (timed_in_process) whose refit is stopped as a SIGTERM agreed by every rank stops it."""
    import rvq_seamless_gpu_cache_nccl as trainer
    from training.signals import Stopped

    def stopped(*args, **kwargs):
        raise Stopped("signal SIGTERM")

    with monkeypatch.context() as patched:
        patched.setattr(trainer, "refit", stopped)
        return timed_in_process(patched, flags)


@pytest.mark.timeout(120)
def test_a_time_budget_stopped_in_its_refit_resumes_to_the_refit_alone(tmp_path, data, monkeypatch):
    out = tmp_path / "run"
    flags = ["--data_dir", data, "--output_dir", out, *TINY, "--kmeans_init_frames", "0", "--eval_every", "100000",
             "--save_every", "100000", "--max_minutes", "0.05"]
    r = stopped_in_its_refit(monkeypatch, flags)
    assert r.returncode == 0, r.stderr[-2000:]
    stop = events(out, "stop")[-1]
    assert stop["reason"] == "signal SIGTERM during the refit"
    saved = newest_checkpoint(out)
    assert saved["end_of_schedule"] == [] and saved["time_spent"] == 3.0
    # the relaunch does the refit and the final eval at the step the clock ended, and trains no step
    r = timed_in_process(monkeypatch, flags)
    assert r.returncode == 0, r.stderr[-2000:]
    last = stop["step"]
    assert max(e["step"] for e in events(out, "train")) == last
    assert (events(out, "stop")[-1]["step"], events(out, "stop")[-1]["reason"]) == (last, "max_minutes")
    assert [e["step"] for e in events(out, "refit")] == [last] and events(out, "eval")[-1]["step"] == last
    assert newest_checkpoint(out)["end_of_schedule"] == ["refit", "final eval"]


def test_eval_reports_dead_codes_and_warns_on_low_usage(tmp_path, data):
    out = tmp_path / "run"
    # 2048 codes and at most 384 held-out frames: every level uses less than 20% of its codes
    r = run_trainer(["--data_dir", data, "--output_dir", out, *TINY, "--codebook_size", "2048", "--max_steps", "4",
                     "--eval_every", "2", "--dead_code_threshold", "0", "--kmeans_init_frames", "0"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    evals = events(out, "eval")
    assert [e["step"] for e in evals] == [2, 4]
    # during training the nearest codes, as training picks them; after the refit, the codec's beam search
    assert [e["beam_size"] for e in evals] == [1, 4] and "codes from a beam search 4 wide" in r.stderr
    for e in evals:
        assert len(e["dead_codes"]) == 2 and all(0 <= d <= 2048 for d in e["dead_codes"])
        assert len(e["code_usage"]) == 2
    assert "use less than 20% of their codes" in r.stderr


@pytest.mark.timeout(120)
def test_a_relaunch_with_only_its_refit_left_reads_the_frames_its_run_chose(tmp_path, monkeypatch):
    """Under --max_minutes the refit reads what fits in its share of the budget at the measured time per frame; a
    run stopped in its refit and relaunched (no step left to measure) reads as many, not --refit_frames."""
    import re

    data = write_dump(tmp_path / "data", train=400, valid=6, seed=5)  # far more frames than the budget's share
    out = tmp_path / "run"
    flags = ["--data_dir", data, "--output_dir", out, *TINY, "--kmeans_init_frames", "0", "--eval_every", "100000",
             "--save_every", "100000", "--max_minutes", "0.05", "--refit_frames", "1000000"]
    r = stopped_in_its_refit(monkeypatch, flags)
    assert r.returncode == 0, r.stderr[-2000:]
    chosen = re.search(r"the refit reads (\d+) frames per rank, not --refit_frames 1000000", r.stderr)
    assert chosen, r.stderr[-2000:]
    frames = int(chosen.group(1))
    r = timed_in_process(monkeypatch, flags)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"the refit reads {frames} frames per rank" in r.stderr
    read = events(out, "refit")[-1]["frames_per_rank"]
    assert frames <= read < frames + 200  # whole utterances, up to the first that reaches the count
