"""The trainer refuses bad input before it writes anything: exit 2, a message naming what is wrong and how to fix
it, no output folder made."""
import numpy as np
import pytest
import torch

from tests.helpers import TINY, run_trainer, trainer_in_process, write_fairseq


def bad_data(tmp_path, case):
    d = tmp_path / "data"
    if case == "missing":
        return d, "does not exist"
    d.mkdir()
    if case == "empty":
        return d, "no training features found"
    if case == "bad_len":
        write_fairseq(d, "train", [40, 50])
        (d / "train_0_1.len").write_text("40\n51\n")
        return d, "lists 91 frames in total but train_0_1.npy has 90 rows"
    if case == "mixed_dims":
        np.save(d / "a.npy", np.zeros((40, 8), np.float32))
        np.save(d / "b.npy", np.zeros((40, 6), np.float32))
        return d, "feature dims differ"
    if case == "too_short":
        write_fairseq(d, "train", [10, 20, 30])
        return d, "no training utterance is long enough"
    if case == "all_nan":  # features that came out NaN throughout (a broken extraction), the held-out split fine
        write_fairseq(d, "train", [40] * 6)
        np.save(d / "train_0_1.npy", np.full((240, 16), np.nan, np.float32))
        write_fairseq(d, "valid", [40] * 2)
        return d, "240 of the 240 frames of 6 utterances read evenly across the split for the features' mean and " \
                  "scale hold NaN or Inf; python -m tools.check"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "empty", "bad_len", "mixed_dims", "too_short", "all_nan"])
def test_bad_data_exits_2_names_it_and_writes_nothing(tmp_path, case):
    data, message = bad_data(tmp_path, case)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, "--output_dir", out, *TINY, "--max_steps", "3"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
    assert not out.exists()


def short_held_out(tmp_path, case):
    """A store whose held-out utterances are all shorter than the eval window; (data, flags, message parts)."""
    d = tmp_path / "data"
    i = TINY.index("--segment_length")
    no_length = TINY[:i] + TINY[i + 2:]  # the automatic segment length
    if case == "holdout":  # 4 extracted utterances, no valid split: --seed 1234 holds out the first (40 frames)
        write_fairseq(d, "train", [40, 100, 120, 150])
        return d, no_length, ["the longest utterance of the 1 utterance(s) held out of 'train' (there is no 'valid' "
                              "split) has 40 frames, fewer than the eval window of 64 frames",
                              "lower --segment_length to at most 40, or add a 'valid' split"]
    write_fairseq(d, "train", np.random.default_rng(0).integers(64, 200, size=20).tolist())
    write_fairseq(d, "valid", [40, 50], seed=1)
    flags = [*TINY, "--segment_length", "64"] if case == "valid_split" else [*no_length, "--multi_length_training"]
    return d, flags, ["held-out split 'valid'", "has 50 frames, fewer than the eval window of 64 frames",
                      "lower --segment_length" + ("s" if case == "multi_length" else "") + " to at most 50",
                      "or choose a --valid_split with utterances of at least 64 frames"]


@pytest.mark.parametrize("case", ["valid_split", "multi_length", "holdout"])
def test_a_held_out_split_with_no_eval_window_exits_2_at_start_and_writes_nothing(tmp_path, case):
    data, flags, message = short_held_out(tmp_path, case)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, "--output_dir", out, *flags, "--max_steps", "3"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no held-out window to evaluate" in r.stderr and "Traceback" not in r.stderr
    for part in message:
        assert part in r.stderr, r.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("splits,argv,missing,flag", [
    (["train", "valid"], ["--train_split", "foo", "--valid_split", "bar"], "foo", "--train_split"),
    (["train"], ["--train_split", "trian"], "trian", "--train_split"),
    (["train", "valid"], ["--valid_split", "dev"], "dev", "--valid_split"),
])
def test_a_split_not_in_a_fairseq_dump_exits_2_naming_the_splits_there(tmp_path, splits, argv, missing, flag):
    d = tmp_path / "data"
    for split in splits:
        write_fairseq(d, split, [100, 120, 140, 160])
    before = sorted(p.name for p in d.iterdir())
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", d, "--output_dir", out, *TINY, "--max_steps", "2", *argv])
    assert r.returncode == 2, r.stderr[-3000:]
    there = ", ".join(repr(s) for s in splits)
    assert f"no split '{missing}' in {d}, which holds the split(s) {there}: give one of them to {flag}" in r.stderr
    assert not out.exists() and sorted(p.name for p in d.iterdir()) == before  # no manifest in the user's folder


@pytest.mark.parametrize("argv,message", [
    (["--batch_size", "0"], "expected a positive number"),
    (["--downsample", "3"], "invalid choice"),
    (["--no_such_flag"], "unrecognized arguments"),
    (["--segment_lengths", "64,x"], "comma-separated"),
    (["--downsample", "4", "--segment_length", "30"], "not multiples of --downsample 4"),
    (["--resume", "/no/such/step_00000008.pt"], "--resume /no/such/step_00000008.pt: cannot read it"),
    (["--ema_decay", "1.5"], "argument --ema_decay: expected a number from 0 to 1, got 1.5"),
    (["--warmup_steps", "-5"], "argument --warmup_steps: expected zero or more, got -5"),
    (["--grad_clip", "-1"], "argument --grad_clip: expected zero or more"),
    (["--device", "tpu"], "--device tpu: not a device; use auto, cpu, cuda or cuda:N"),
    (["--device", "mps"], "--device mps: not supported"),
    (["--max_minutes", "inf"], "argument --max_minutes: expected a finite number, got 'inf'"),
    (["--seed", "-5"], "argument --seed: expected a whole number from 0 to 4294967295, got -5"),
    (["--codebook_size", "2"], "--beam_size 4 is larger than --codebook_size 2: the beam search keeps at most one"),
])
def test_bad_flags_exit_2(tmp_path, argv, message):
    r = trainer_in_process([*argv, "--output_dir", tmp_path / "run"])
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_bad_flag_ends_the_command_with_exit_2(tmp_path):
    """The tests above run the trainer's main() in the test's process; this one runs the command."""
    r = run_trainer(["--batch_size", "0", "--output_dir", tmp_path / "run"], timeout=60)
    assert r.returncode == 2 and "argument --batch_size: expected a positive number" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_an_empty_output_dir_exits_2_and_writes_nothing_in_the_current_folder(tmp_path):
    r = trainer_in_process(["--output_dir", ""], cwd=tmp_path)
    assert r.returncode == 2 and "argument --output_dir: expected a folder, got an empty name" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--max_minutes", "nan"], ["--lr", "inf"], ["--lr", "nan"],
                                  ["--gpu_cache_gb", "inf"], ["--weight_decay", "inf"], ["--grad_clip", "nan"],
                                  ["--dead_code_threshold", "inf"], ["--commitment_weight", "nan"]])
def test_a_float_flag_that_is_not_finite_is_refused(argv, capsys):
    from training.config import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(argv)
    assert exit.value.code == 2
    assert f"argument {argv[0]}: expected a finite number, got '{argv[1]}'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is no bad flag here")
def test_device_cuda_without_a_gpu_exits_2(tmp_path):
    r = trainer_in_process(["--device", "cuda", "--output_dir", tmp_path / "run"])
    assert r.returncode == 2 and "--device cuda was asked for, but no GPU is visible" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_bad_fault_spec_exits_2(tmp_path):
    r = trainer_in_process(["--output_dir", tmp_path / "run", *TINY], extra_env={"RVQ_FAULT": "explode:rank=0"})
    assert r.returncode == 2 and "unknown fault 'explode'" in r.stderr


def test_a_relative_data_dir_that_does_not_exist_is_named_where_it_was_looked_for(tmp_path, monkeypatch, caplog):
    """`--data_dir feats` from another folder: the trainer and tools.encode say the absolute path they looked at."""
    from tests.audio_helpers import random_codec
    from tools import encode

    (tmp_path / "elsewhere").mkdir()
    looked = f"--data_dir feats does not exist: looked for {tmp_path / 'elsewhere' / 'feats'}"
    r = trainer_in_process(["--data_dir", "feats", "--output_dir", tmp_path / "run", *TINY, "--max_steps", "3"],
                           cwd=tmp_path / "elsewhere")
    assert r.returncode == 2 and looked in r.stderr, r.stderr[-2000:]
    codec = random_codec(tmp_path / "codec.pt", tmp_path)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert encode.main(["--checkpoint", codec, "--data_dir", "feats", "--output_dir", "codes"]) == 2
    assert looked in caplog.text and not (tmp_path / "elsewhere" / "codes").exists()
