"""tools.report (plots and report.md from metrics.jsonl) and MetricsLog's optional TensorBoard scalars."""
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest

from errors import BadInputError
from training.metrics_log import MetricsLog

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, steps=40, levels=3):
    """A metrics.jsonl as the trainer writes it, with a resume (steps 21-25 logged twice) and a cut last line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir / "metrics.jsonl")
    for step in [*range(1, 26), *range(21, steps + 1)]:
        log.write("train", step, loss=1 / step, recon=0.8 / step, commit=0.1 / math.sqrt(step), lr=1e-3,
                  frames_per_sec=1000.0 + step, segment_length=32, bad_steps=0)
        if step % 10 == 0:
            log.write("eval", step, rel_mse=1 / step, cosine=1 - 1 / step,
                      code_usage=[0.5 + q / 10 for q in range(levels)],
                      perplexity=[10.0 + q + step / 10 for q in range(levels)], bits_per_frame=15.0, frames=512)
            log.write("checkpoint", step, path=str(run_dir / "checkpoints" / f"step_{step:08d}.pt"))
    log.write("skipped_step", 13, reason="non-finite loss or gradient", bad_steps=1)
    log.write("train", 14, loss=float("nan"), recon=float("nan"), commit=0.1, lr=1e-3, frames_per_sec=900.0)
    log.write("eval_failed", 30, ranks=[1])
    log.write("stop", steps, reason="max_steps")
    log.close()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"event": "train", "step": 41, "lo')  # killed mid-write
    (run_dir / "config.json").write_text(json.dumps({"codebook_size": 32, "num_quantizers": levels, "lr": 1e-3}))


@pytest.mark.slow
def test_report_writes_png_plots_and_a_summary(tmp_path):
    from tools import report

    write_run(tmp_path / "run")
    assert report.main([tmp_path / "run"]) == 0
    out = tmp_path / "run" / "report"
    for name in report.PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, name
    text = (out / "report.md").read_text()
    assert "| last step | 40 (stopped: max_steps) |" in text
    assert "0.1 at step 10 -> 0.025 at step 40" in text  # eval rel_mse, first and last
    assert "| failed evals | 1 at steps [30] |" in text and "| skipped steps (non-finite) | 1 |" in text
    assert "| unreadable lines in metrics.jsonl | 1 |" in text
    assert "0.5, 0.6, 0.7" in text  # code usage per level at the last eval
    for name in report.PLOTS:
        assert f"({name})" in text
    assert report.main([tmp_path / "run", "--out", tmp_path / "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "codes.png").read_bytes().startswith(PNG_SIGNATURE)


def test_report_keeps_the_last_record_of_a_step_logged_twice(tmp_path):
    from tools.report import read_events

    write_run(tmp_path / "run")
    events, bad = read_events(tmp_path / "run" / "metrics.jsonl")
    steps = [r["step"] for r in events["train"]]
    assert steps == list(range(1, 41)) and bad == 1
    assert events["train"][13]["loss"] is None  # step 14 logged again with a NaN loss: the later line wins


JUNK = [
    '{"event": "train", "step": 1e400, "loss": 0.5}',  # a step past float's range: inf
    '{"event": "train", "step": NaN}', '{"event": "train", "step": true}', '{"event": "eval", "step": "x"}',
    '{"step": 5}', '[1, 2]', '"train"', '17', 'null', '{"event": "train"}',
    '{"event": "eval", "step": 33, "rel_mse": 1e400, "cosine": "high", "code_usage": 7, "perplexity": [1, "x"],'
    ' "bits_per_frame": {"a": 1}}',  # an event whose fields are junk: reported as missing
    '{"event": "train", "step": 34, "loss": [1], "lr": "x", "frames_per_sec": 99999999999999999999999999999999999'
    '9999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999'
    '99999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999'
    '99999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999999}',
]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_report_on_a_folder_named_in_no_utf8_with_junk_lines_reports_what_it_can(tmp_path):
    import os
    import subprocess

    from tests.helpers import REPO, env

    run_dir = tmp_path / os.fsdecode(b"run-\xe9t\xe9")  # a Latin-1 name, as an old archive gives it
    write_run(run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("\n" + "\n".join(JUNK) + "\n")
        f.write(json.dumps({"event": "checkpoint", "step": 40, "path": str(run_dir / "step_00000040.pt")}) + "\n")
    r = subprocess.run([sys.executable, "-m", "tools.report", os.fsencode(run_dir)], capture_output=True,
                       text=True, timeout=100, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (run_dir / "report" / "report.md").read_text()
    assert "# Training report: " in text and "run-\ufffdt\ufffd" in text
    assert f"| unreadable lines in metrics.jsonl | {1 + len(JUNK) - 2} |" in text  # the cut line, and the junk
    assert "| last step | 40 (stopped: max_steps) |" in text and "| eval cosine (last) | 0.975 |" in text
    assert "run-?t?/step_00000040.pt |" in text  # a path in an event, written as it could be
    assert (run_dir / "report" / "codes.png").read_bytes().startswith(PNG_SIGNATURE)


def test_report_without_metrics_exits_2(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    from tools import report

    assert report.main([tmp_path]) == 2
    assert "metrics.jsonl does not exist" in caplog.text
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main([tmp_path]) == 2
    assert "holds no events" in caplog.text
    assert not (tmp_path / "report").exists()


def test_metrics_log_without_tensorboard_is_unchanged(tmp_path):
    MetricsLog(None).write("train", 1, loss=1.0)  # other ranks: writes nothing, needs nothing
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write("train", 3, loss=float("inf"), code_usage=[0.5])
    log.close()
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert record["event"] == "train" and record["step"] == 3 and record["loss"] is None
    assert record["code_usage"] == [0.5] and "time" in record


def named_install_file(message: str, package: str) -> Path:
    """The requirements file a missing-package message tells the user to install, checked to list `package`."""
    match = re.search(r"pip install -r (\S+)", message)
    assert match, message
    path = REPO / match.group(1)
    listed = [re.split(r"[<>=\s]", line)[0] for line in path.read_text().splitlines() if line and line[0].isalpha()]
    assert package in listed, (path, listed)
    return path


def test_tensorboard_needs_its_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(BadInputError, match="tensorboard package") as refused:
        MetricsLog(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    named_install_file(str(refused.value), "tensorboard")
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_report_without_matplotlib_names_an_install_file_the_dev_install_includes(tmp_path, monkeypatch):
    from tools import report

    write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(BadInputError, match="needs matplotlib") as refused:
        report.write_report(tmp_path / "run", tmp_path / "run" / "report")
    path = named_install_file(str(refused.value), "matplotlib")
    assert f"-r {path.name}" in (REPO / "requirements-dev.txt").read_text().splitlines()
    assert not (tmp_path / "run" / "report").exists()


def test_tensorboard_scalars_per_event_field_and_level(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    log.write("train", 1, loss=0.5, lr=1e-3, frames_per_sec=1200.0, segment_length=32)
    log.write("train", 2, loss=0.25, lr=1e-3, frames_per_sec=1300.0, segment_length=64)
    log.write("eval", 2, rel_mse=0.1, code_usage=[0.75, 0.5], perplexity=[20.0, 12.5], bits_per_frame=10.0)
    log.write("stop", 2, reason="max_steps")
    log.close()
    scalars = EventAccumulator(str(tmp_path / "tb"))
    scalars.Reload()
    tags = set(scalars.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/frames_per_sec", "train/segment_length", "eval/rel_mse",
            "eval/code_usage/level_0", "eval/code_usage/level_1", "eval/perplexity/level_1",
            "eval/bits_per_frame"} <= tags
    assert not any(t.startswith("stop/") for t in tags)
    assert [(e.step, e.value) for e in scalars.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in scalars.Scalars("eval/code_usage/level_1")] == [(2, 0.5)]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 4  # the JSON log is still written


@pytest.mark.slow
def test_final_evals_with_phone_measures_get_a_plot_per_level_and_rows(tmp_path):
    from tools import report

    run = tmp_path / "run"
    write_run(run)
    log = MetricsLog(run / "metrics.jsonl")
    for step, pnmi in ((40, [0.41, 0.22, None]), (60, [0.45, 0.25, 0.12])):  # a resumed run's second final eval
        log.write("eval", step, rel_mse=0.3, cosine=0.8, code_usage=[0.9, 0.9, 0.9], perplexity=[20.0, 21.0, 22.0],
                  bits_per_frame=15.0, frames=512, scored="whole utterances", beam_size=4, phones=41, pnmi=pnmi,
                  phone_purity=[0.5, 0.3, 0.2], cluster_purity=[0.1, 0.05, 0.04])
    log.close()
    assert report.main([run]) == 0
    out = run / "report"
    assert (out / report.PHONE_PLOT).read_bytes().startswith(PNG_SIGNATURE)
    text = (out / "report.md").read_text()
    assert "| PNMI per level (final eval at step 60, 41 phones) | 0.45, 0.25, 0.12 |" in text
    assert "| phone purity per level (same) | 0.5, 0.3, 0.2 |" in text
    assert f"({report.PHONE_PLOT})" in text
    plain = tmp_path / "plain"  # a run without phone labels: no plot, no row
    write_run(plain)
    assert report.main([plain]) == 0
    assert not (plain / "report" / report.PHONE_PLOT).exists()
    assert "PNMI" not in (plain / "report" / "report.md").read_text()


def test_config_json_and_the_reports_command_hold_the_flags_as_given(tmp_path):
    """--batch_size 16 with the automatic segment length: config.json says 16, as the command did, the log says
    what it made of it, and report.md's command lists only flags that were given (no --segment_length chosen,
    no --nccl_timeout at its default)."""
    import shlex

    from tests.helpers import QUICK, trainer_in_process, write_dump
    from tools import report

    data = write_dump(tmp_path / "data", train=40, valid=4, seed=3)  # 40-199 frames: an automatic length below 128
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, "--output_dir", out, "--latent_dim", "16", "--num_quantizers", "2",
                            "--codebook_size", "16", "--batch_size", "16", "--max_steps", "1", *QUICK,
                            "--refit_iters", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    chosen = re.search(r"segment length (\d+) \(automatic.*?(\d+) crops per step: the frames of batch size 16 at "
                       r"128 frames a crop", r.stderr)
    assert chosen and int(chosen.group(1)) < 128 and int(chosen.group(2)) > 16, r.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["batch_size"] == 16 and config["segment_length"] is None
    report.write_report(out, tmp_path / "report")
    command = re.search(r"```bash\n(python rvq_seamless_gpu_cache_nccl.py .*)\n```",
                        (tmp_path / "report" / "report.md").read_text()).group(1)
    argv = shlex.split(command)[2:]
    assert argv[argv.index("--batch_size") + 1] == "16"
    assert "--segment_length" not in argv and "--nccl_timeout" not in argv
