"""The trainer from the command line: bad input, single process, resume, signals."""
import argparse
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import TINY, events, run_trainer, trainer_in_process, write_fairseq


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
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "empty", "bad_len", "mixed_dims", "too_short"])
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
])
def test_bad_flags_exit_2(tmp_path, argv, message):
    r = trainer_in_process([*argv, "--output_dir", tmp_path / "run"])
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "run").exists()


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


def test_help_lists_every_flag():
    from training.config import build_parser

    r = trainer_in_process(["--help"])  # `python rvq_seamless_gpu_cache_nccl.py --help` itself: tests/test_help.py
    assert r.returncode == 0, r.stderr[-2000:]
    flags = [o for a in build_parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    assert len(flags) > 50 and all(f in r.stdout for f in flags), [f for f in flags if f not in r.stdout]
    assert "2% of training utterances are held out" in " ".join(r.stdout.split())  # a % shows as it is


def test_bad_fault_spec_exits_2(tmp_path):
    r = trainer_in_process(["--output_dir", tmp_path / "run", *TINY], extra_env={"RVQ_FAULT": "explode:rank=0"})
    assert r.returncode == 2 and "unknown fault 'explode'" in r.stderr


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    lengths = np.random.default_rng(1).integers(40, 200, size=60).tolist()
    write_fairseq(d, "train", lengths, dim=16, seed=1)
    write_fairseq(d, "valid", [64] * 6, dim=16, seed=2)
    return d


def weights(run_dir):
    from training.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])


def test_stop_and_resume_gives_identical_weights(tmp_path, small_data):
    common = ["--data_dir", small_data, *TINY, "--max_steps", "24", "--eval_every", "8", "--save_every", "100",
              "--multi_length_training", "--segment_lengths", "16,32,64", "--quantize_dropout"]
    straight = tmp_path / "straight"
    r = trainer_in_process([*common, "--output_dir", straight])
    assert r.returncode == 0, r.stderr[-3000:]

    split = tmp_path / "split"
    r = run_trainer([*common, "--output_dir", split], extra_env={"RVQ_FAULT": "signal:step=12:sig=TERM"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SIGTERM received" in r.stderr
    stops = events(split, "stop")  # the signal lands during step 13: the run stops when that step is done
    assert stops[-1]["step"] == 13 and "SIGTERM" in stops[-1]["reason"]
    assert [e["step"] for e in events(split, "checkpoint")] == [13]

    r = trainer_in_process([*common, "--output_dir", split])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 13" in r.stderr

    a, b = weights(straight), weights(split)
    assert a["step"] == b["step"] == 24
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)

    trained = len(events(split, "train"))  # the same command once more: a finished run says so, and trains nothing
    r = trainer_in_process([*common, "--output_dir", split])
    assert r.returncode == 0 and "holds a finished run (step 24" in r.stderr, r.stderr[-3000:]
    assert "give another --output_dir" in r.stderr and len(events(split, "train")) == trained


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


def test_truncated_checkpoint_falls_back_to_the_previous(tmp_path, small_data):
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--save_every", "4", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "8"]).returncode == 0
    newest = out / "checkpoints" / "step_00000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    r = trainer_in_process([*common, "--max_steps", "10"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unreadable" in r.stderr and "at step 4" in r.stderr


def test_a_run_that_would_start_behind_the_checkpoints_in_its_output_dir_exits_2_and_keeps_them(tmp_path, small_data):
    """--resume none in a run dir, or an older --resume path: the new run's checkpoints would be the oldest there,
    pruned first under --keep_checkpoints, and a later --resume auto would pick the old run's."""
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--refit_iters", "0", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "12", "--save_every", "4"]).returncode == 0
    folder = out / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for resume, start in (("none", 0), (str(folder / "step_00000004.pt"), 4)):
        r = trainer_in_process([*common, "--max_steps", "14", "--save_every", "2", "--resume", resume])
        assert r.returncode == 2, r.stderr[-3000:]
        assert (f"holds checkpoints of another run, up to step_00000012.pt, ahead of step {start} where this run "
                f"starts (--resume {resume})") in r.stderr
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    r = trainer_in_process([*common, "--max_steps", "14", "--save_every", "2", "--resume",
                            str(folder / "step_00000012.pt")])
    assert r.returncode == 0 and "at step 12" in r.stderr, r.stderr[-3000:]  # the newest: nothing ahead of it


def test_unreadable_checkpoints_are_moved_aside_and_never_push_new_ones_out(tmp_path, small_data):
    """Every checkpoint truncated: the run starts at step 0, and the retention window holds its own checkpoints,
    not the unreadable ones (which sort newer); those are kept, renamed, and never overwritten."""
    out = tmp_path / "run"
    common = ["--data_dir", small_data, *TINY, "--eval_every", "100", "--refit_iters", "0", "--output_dir", out]
    assert trainer_in_process([*common, "--max_steps", "12", "--save_every", "4"]).returncode == 0
    folder = out / "checkpoints"
    cut = {}
    for step in (4, 8, 12):
        path = folder / f"step_{step:08d}.pt"
        cut[step] = path.read_bytes()[:path.stat().st_size // 2]
        path.write_bytes(cut[step])
    r = trainer_in_process([*common, "--max_steps", "10", "--save_every", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("is unreadable (RuntimeError: PytorchStreamReader failed") == 3
    assert r.stderr.count("moved aside") == 3 and "resumed from" not in r.stderr
    assert [e["step"] for e in events(out, "checkpoint")[-5:]] == [2, 4, 6, 8, 10]
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000004.pt.unreadable", "step_00000006.pt", "step_00000008.pt", "step_00000008.pt.unreadable",
        "step_00000010.pt", "step_00000012.pt.unreadable"]
    assert all((folder / f"step_{step:08d}.pt.unreadable").read_bytes() == cut[step] for step in cut)
    assert weights(out)["step"] == 10  # the newest readable one is what --resume auto continues from

    r = trainer_in_process([*common, "--max_steps", "12", "--save_every", "2"])  # moved aside once: no warning again
    assert r.returncode == 0 and "is unreadable" not in r.stderr and "at step 10" in r.stderr, r.stderr[-3000:]


def test_an_empty_or_truncated_checkpoint_is_reported_with_the_reason(tmp_path, caplog):
    from training.checkpoint import load_latest, save_checkpoint

    good = {"step": 2, "model": {}, "codec": {}}
    save_checkpoint(tmp_path, 2, good, keep=4)
    (tmp_path / "step_00000004.pt").write_bytes(b"")
    (tmp_path / "step_00000006.pt").write_bytes(b"not a checkpoint")
    save_checkpoint(tmp_path, 8, {"step": 8}, keep=4)  # a well-formed torch file, but no checkpoint
    path, state = load_latest(tmp_path)
    assert path.name == "step_00000002.pt" and state == good
    assert "step_00000004.pt is unreadable (empty file)" in caplog.text
    assert "step_00000006.pt is unreadable (not a torch checkpoint, or one holding objects other than tensors" \
        in caplog.text
    assert "step_00000008.pt is unreadable (a torch file without a checkpoint's content (no 'model', 'codec'))" \
        in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == "step_00000008.pt"  # load_latest only reads


def test_nan_loss_step_is_skipped_and_counted(tmp_path, small_data):
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, *TINY, "--max_steps", "8", "--output_dir", out],
                           extra_env={"RVQ_FAULT": "nan:step=3"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["step"] for e in events(out, "skipped_step")] == [4]
    assert events(out, "train")[-1]["bad_steps"] == 1


def test_a_nan_frame_in_the_data_is_dropped_named_once_and_never_used_again(tmp_path):
    data = tmp_path / "data"
    for split, n, bad_row in (("train", 8, 3 * 40 + 20), ("valid", 4, 64 + 10)):
        utts = write_fairseq(data, split, [40] * n if split == "train" else [64] * n)
        arr = np.concatenate(utts)
        arr[bad_row, 5] = np.nan  # every 32-frame crop of train utterance 3 covers its frame 20
        np.save(data / f"{split}_0_1.npy", arr)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, *TINY, "--max_steps", "12", "--eval_every", "6", "--output_dir", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("train_0_1.npy utterance 3 (rows 120-160)") == 1
    train = events(out, "train")
    found = next(k for k, e in enumerate(train) if e["bad_utterances"] == 1)
    assert train[found]["dropped_crops"] >= 1 and train[-1]["bad_utterances"] == 1
    assert {e["dropped_crops"] for e in train[found:]} == {train[found]["dropped_crops"]}  # never drawn again
    assert all(math.isfinite(e["loss"]) for e in train) and not events(out, "skipped_step")
    assert all(math.isfinite(e["rel_mse"]) for e in events(out, "eval"))
    final = weights(out)["model"]
    assert all(torch.isfinite(v).all() for k, v in final.items() if "rvq" in k and v.is_floating_point())


@pytest.mark.parametrize("source", [
    ["--use_gpu_cache", "--gpu_cache_gb", "0.0001", "--prefetch"],  # part cached, the rest prefetched
    ["--prefetch"],
    ["--use_gpu_cache", "--gpu_cache_gb", "0.0001", "--prefetch", "--multi_length_training", "--segment_lengths",
     "16,32"],
], ids=["partial_cache_prefetch", "prefetch", "multi_length_partial_prefetch"])
def test_utterances_with_nan_rows_are_dropped_and_named_once_by_every_batch_source(tmp_path, source):
    """A folder of utterances, every second one with NaN rows: bad utterances are found while batches ahead of
    the step are already planned (prefetched, or partly cached and partly streamed)."""
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("valid", 2)):
        (data / split).mkdir(parents=True)
        for i in range(n):
            u = rng.standard_normal((int(rng.integers(40, 120)), 16)).astype(np.float32)
            if split == "train" and i % 2:
                u[5:-5, 0] = np.nan  # every 32-frame crop of it has a NaN frame
            np.save(data / split / f"u{i:03d}.npy", u)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, *TINY, "--max_steps", "24", "--output_dir", out, *source])
    assert r.returncode == 0, r.stderr[-3000:]
    named = [line.split(" in ", 1)[1].split(":", 1)[0] for line in r.stderr.splitlines()
             if "non-finite values (NaN or Inf) in" in line]
    assert named and len(named) == len(set(named))  # each bad utterance named once
    assert all(int(Path(n).stem[1:]) % 2 for n in named)
    train = events(out, "train")
    assert train[-1]["bad_utterances"] == len(named) and train[-1]["dropped_crops"] >= len(named)


def test_float16_and_float32_dumps_of_the_same_features_train_alike(tmp_path):
    """Features with float16 values, stored as float32 and as float16: the same batches, the same losses."""
    for dtype in ("float32", "float16"):
        d = tmp_path / dtype
        write_fairseq(d, "train", [120] * 12, seed=7, dtype=np.float16)
        write_fairseq(d, "valid", [64] * 2, seed=8, dtype=np.float16)
        for split in ("train", "valid"):
            np.save(d / f"{split}_0_1.npy", np.load(d / f"{split}_0_1.npy").astype(dtype))
    losses = {}
    for dtype, extra in (("float32", []), ("float16", []), ("float16", ["--use_gpu_cache"])):
        out = tmp_path / f"run_{dtype}_{len(extra)}"
        r = trainer_in_process(["--data_dir", tmp_path / dtype, *TINY, "--max_steps", "4", "--refit_iters", "0",
                                "--output_dir", out, *extra])
        assert r.returncode == 0, r.stderr[-3000:]
        losses[(dtype, len(extra))] = [e["loss"] for e in events(out, "train")]
    assert losses[("float16", 0)] == pytest.approx(losses[("float32", 0)], rel=1e-6)
    assert losses[("float16", 1)] == pytest.approx(losses[("float32", 0)], rel=1e-6)


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


def test_first_sigint_requests_a_stop_and_the_second_exits_at_once():
    import subprocess
    import sys

    from tests.helpers import REPO, env

    script = (
        "import os, signal\n"
        "from training.signals import StopRequest\n"
        "stop = StopRequest().install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('stop requested:', stop.reason, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('still running', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env(), cwd=REPO)
    assert r.returncode == 130
    assert "stop requested: SIGINT" in r.stdout and "still running" not in r.stdout


def test_a_checkpoint_resumes_into_its_own_codec_and_a_field_it_predates_counts_at_its_default(tmp_path):
    import dataclasses

    from errors import BadInputError
    from models.codec import CodecConfig
    from training.checkpoint import check_codec

    codec = CodecConfig(feature_dim=16)
    older = {k: v for k, v in codec.to_dict().items() if k != "beam_size"}  # saved before --beam_size existed
    check_codec(tmp_path / "a.pt", {"codec": older}, codec)
    for other in (dataclasses.replace(codec, beam_size=1), dataclasses.replace(codec, codebook_size=512)):
        with pytest.raises(BadInputError, match="differs from this run's flags"):
            check_codec(tmp_path / "a.pt", {"codec": older}, other)
