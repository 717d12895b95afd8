"""One run per --output_dir: a second run into it (one process, or several ranks) exits 2 within seconds naming
the first and touches nothing; a folder that cannot be written exits 2 before anything is written."""
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import (Ranks, TINY, TRAINER, env, events, run_flags, run_trainer, start_python, trainer_in_process,
                           tree, write_dump)

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("data"), train=40, valid=4, seed=5)


def flags(data, out, *extra):
    return run_flags(data, out, "--eval_every", "100", "--refit_iters", "0", *extra)


@pytest.mark.timeout(200)
def test_a_second_run_into_a_busy_output_dir_exits_2_naming_the_first_and_touches_nothing(tmp_path, data):
    out = tmp_path / "run"
    first = start_python([TRAINER, *flags(data, out, "--max_steps", 12, "--save_every", 4)],
                         stdout=tmp_path / "first.log", env=env())
    others = None
    try:
        deadline = time.monotonic() + 120
        while "training for" not in (tmp_path / "first.log").read_text():  # logged once it holds the lock
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # stopped mid-run, not dead: its output dir is still its own
        before = tree(out)
        started = time.monotonic()
        # a job submitted twice: as one process, and as two ranks whose rank 0 finds the lock taken
        others = Ranks(flags(data, out, "--max_steps", 12), log_dir=tmp_path / "ranks")
        second = run_trainer(flags(data, out, "--max_steps", 12), timeout=120)
        assert others.wait(timeout=120) == [2, 2], others.output(0) + others.output(1)
        took = time.monotonic() - started
        assert tree(out) == before  # no config.json, metrics line, checkpoint or manifest of theirs
    finally:
        first.send_signal(signal.SIGCONT)
        if others is not None:
            others.close()
    holder = f"is being written by another process (pid {first.pid} on host {socket.gethostname()}, since "
    assert second.returncode == 2 and f"--output_dir {out} {holder}" in second.stderr, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    for rank in (0, 1):
        assert holder in others.output(rank), others.output(rank)[-3000:]
    assert f"rank 0: --output_dir {out} {holder}" in others.output(1)
    print(f"the second run and the two ranks were refused within {took:.1f} s of their start")
    assert took < 60  # process start and the data checks, on 2 busy cores

    assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    # the first run's files are its own alone: one run's events, its checkpoints
    rows = events(out)
    assert len({(r["event"], r["step"]) for r in rows}) == len(rows)
    assert [r["step"] for r in rows if r["event"] == "train"] == list(range(1, 13))
    assert [r["step"] for r in events(out, "checkpoint")] == [4, 8, 12]
    assert len(events(out, "stop")) == 1


@pytest.mark.parametrize("case", ["file", "under_a_file", "read_only"])
def test_an_output_dir_that_cannot_be_written_exits_2_and_writes_nothing(tmp_path, data, case):
    if case == "file":
        out = tmp_path / "run"
        out.write_text("not a folder")
        message = f"--output_dir {out} is a file, not a folder"
    elif case == "under_a_file":
        (tmp_path / "file").write_text("not a folder")
        out = tmp_path / "file" / "run"
        message = f"--output_dir {out} cannot be made or written (Not a directory)"
    elif os.geteuid() == 0:  # root writes into any folder of a writable filesystem: sysfs is one it cannot
        out = Path("/sys/kernel/rvq_run")
        message = f"--output_dir {out} cannot be made or written (Operation not permitted)"
    else:
        out = tmp_path / "run"
        out.mkdir(mode=0o555)
        message = "Permission denied"
    before = tree(tmp_path)
    r = run_trainer(flags(data, out, "--max_steps", 2), timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert tree(tmp_path) == before


def test_outputs_of_a_run(tmp_path, small_data):
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, *TINY, "--max_steps", "10", "--eval_every", "5",
                            "--save_every", "4", "--keep_checkpoints", "2", "--output_dir", out])
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    config = json.loads((out / "config.json").read_text())
    assert config["max_steps"] == 10 and config["data_dir"] == str(small_data)
    train = events(out, "train")
    assert [e["step"] for e in train] == list(range(1, 11))
    assert all({"loss", "lr", "frames_per_sec"} <= e.keys() for e in train)
    evals = events(out, "eval")
    assert [e["step"] for e in evals] == [5, 10]
    for e in evals:
        assert len(e["code_usage"]) == len(e["perplexity"]) == 2
        assert e["bits_per_frame"] == 10 and 0 < e["rel_mse"] and -1 <= e["cosine"] <= 1
    assert [e["step"] for e in events(out, "checkpoint")] == [4, 8, 10]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000008.pt", "step_00000010.pt"]
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 10, "reason": "max_steps"}


def test_eval_frames_bound_every_eval(tmp_path, small_data):
    """6 held-out utterances of 64 frames make 12 windows of 32; --eval_frames 128 evaluates 4 of them."""
    common = ["--data_dir", small_data, *TINY, "--max_steps", "4", "--eval_every", "2", "--refit_iters", "0"]
    r = trainer_in_process([*common, "--eval_frames", "128", "--output_dir", tmp_path / "bounded"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval: 4 of this rank's 12 held-out windows" in r.stderr
    assert [e["frames"] for e in events(tmp_path / "bounded", "eval")] == [128, 128]
    r = trainer_in_process([*common, "--eval_frames", "0", "--output_dir", tmp_path / "every"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["frames"] for e in events(tmp_path / "every", "eval")] == [384, 384]


@pytest.mark.timeout(120)
def test_a_finished_run_ends_by_naming_the_next_steps_with_its_paths(tmp_path, small_data, caplog):
    """The last line of a finished run: tools.report and tools.encode with the run's folder and data, commands
    that work as given; a run stopped before its end names none."""
    import logging
    import shlex

    from tools import encode, report

    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, *TINY, "--max_steps", "3", "--refit_iters", "0",
                            "--output_dir", out])
    assert r.returncode == 0, r.stderr[-3000:]
    last = [line for line in r.stderr.splitlines() if "[rank0]" in line][-1]
    assert "INFO next: " in last, r.stderr[-3000:]
    report_args = shlex.split(last.split("python -m tools.report ", 1)[1].split(" plots", 1)[0])
    encode_args = shlex.split(last.split("python -m tools.encode ", 1)[1].split(" writes", 1)[0])
    assert report_args == [str(out.absolute())]
    assert encode_args[encode_args.index("--data_dir") + 1] == str(small_data.resolve())
    caplog.set_level(logging.INFO)
    assert report.main(report_args) == 0
    encode_args[encode_args.index("--output_dir") + 1] = str(tmp_path / "codes")
    assert encode.main(encode_args) == 0 and (tmp_path / "codes" / "train_0_1.codes.npy").is_file()
    stopped = trainer_in_process(["--data_dir", small_data, *TINY, "--max_steps", "3", "--output_dir",
                                  tmp_path / "stopped"], extra_env={"RVQ_FAULT": "signal:step=1:sig=TERM"})
    assert stopped.returncode == 0 and "finished at step 2: signal SIGTERM" in stopped.stderr, stopped.stderr[-3000:]
    assert "next: " not in stopped.stderr
