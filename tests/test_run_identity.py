"""A run continues only on the data it began with and writes only into its own folder: a resume on other data,
a folder of another program, a changed codec and an audio --data_dir each exit 2 naming what differs, with a
fix that works, and leave the disk as they found it; --finetune continues on other data and says so."""
import json
import re
import shutil

import numpy as np
import pytest
import torch

from tests.audio_helpers import run_module, write_corpus
from tests.helpers import TINY, Ranks, events, run_trainer, trainer_in_process, tree, write_fairseq
from training.checkpoint import list_checkpoints
from training.config import parse_args, save_config
from training.output_dir import OutputDirLock
from training.run_folder import LOCK_FILE, MARKER

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

QUICK = [*TINY, "--eval_every", "100", "--refit_iters", "0", "--eval_frames", "256"]  # a small final eval


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """40 steps on the built-in demo corpus (no --data_dir); each test trains on from a copy."""
    out = tmp_path_factory.mktemp("demo") / "run"
    r = run_trainer([*QUICK, "--max_steps", 40, "--output_dir", out], timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fbank(tmp_path_factory):
    """fbank-like features of the demo's width from another store, with tools.extract's note beside the shard."""
    d = tmp_path_factory.mktemp("fbank")
    write_fairseq(d, "train", np.random.default_rng(3).integers(60, 200, size=30).tolist(), dim=160, seed=3)
    note = {"feature": "fbank", "dim": 160, "frame_rate_hz": 50, "sample_rate": 16000, "dtype": "float32"}
    (d / "train_0_1.json").write_text(json.dumps(note))
    return d


def newest(run) -> dict:
    return torch.load(list_checkpoints(run / "checkpoints")[0], map_location="cpu", weights_only=True)


@pytest.mark.timeout(240)
def test_a_resume_on_other_data_exits_2_on_every_rank_and_finetune_goes_on_recording_it(tmp_path, demo_run, fbank):
    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    flags = ["--data_dir", fbank, "--output_dir", run, *QUICK, "--max_steps", 50]
    before = tree(run)
    r = trainer_in_process(flags)
    assert r.returncode == 2, r.stderr[-3000:]
    said = r.stderr
    assert ("step_00000040.pt (step 40) was trained on other data than this run's (features: demo features" in said
            and "-> fbank (160-d, stored as float32); utterances: 400 -> 30; frames: " in said), said[-3000:]
    assert "dim:" not in said and "files:" not in said and "split:" not in said  # only what differs is named
    assert ("To continue it, give no --data_dir (the demo corpus); to fine-tune it on these data, add --finetune; "
            "to train afresh on them, give another --output_dir") in said
    assert "Traceback" not in said
    assert tree(run) == before  # config.json, the checkpoints, the lock file and the marker as they were

    ranks = Ranks(flags, log_dir=tmp_path / "refused")  # rank 0 decides; rank 1 learns it over the control plane
    try:
        assert ranks.wait(timeout=150) == [2, 2], ranks.output(0)[-3000:] + ranks.output(1)[-3000:]
        assert "rank 0: checkpoint" in ranks.output(1) and "trained on other data" in ranks.output(1)
    finally:
        ranks.close()
    assert tree(run) == before

    tuned = Ranks([*flags, "--finetune"], log_dir=tmp_path / "finetune")
    try:
        assert tuned.wait(timeout=180) == [0, 0], tuned.output(0)[-3000:] + tuned.output(1)[-3000:]
        assert "--finetune: checkpoint" in tuned.output(0) and "goes on with other data" in tuned.output(0)
    finally:
        tuned.close()
    state = newest(run)
    assert state["step"] == 50 and state["config"]["finetune"] is True
    assert state["data"]["features"]["feature"] == "fbank" and state["config"]["features"]["feature"] == "fbank"
    assert state["data"]["store"]["utterances"] == 30
    (before_tune,) = state["data_history"]
    assert before_tune["step"] == 40 and before_tune["data"]["features"]["feature"] == "demo"
    # the codec standardises the fbank features by their own statistics, not the demo's
    assert abs(state["data"]["stats"]["mean"]) < 0.1 and abs(state["data"]["stats"]["std"] - 1) < 0.1
    assert before_tune["data"]["stats"]["mean"] < -1
    assert json.loads((run / "config.json").read_text())["data_dir"] == str(fbank)
    assert [e["step"] for e in events(run, "train")][-10:] == list(range(41, 51))


def foreign_folders(tmp_path):
    """A Hugging Face model folder (a swapped --checkpoint and --output_dir) and a folder of someone's notes."""
    model = tmp_path / "w2v-bert-2.0"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Wav2Vec2BertModel"],
                                                   "model_type": "wav2vec2-bert", "hidden_size": 1024}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    (model / "preprocessor_config.json").write_text("{}")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("train a codec\n")
    return [(model, "a config.json this trainer did not write, and model.safetensors, preprocessor_config.json"),
            (notes, "todo.txt")]


@pytest.mark.timeout(120)
def test_an_output_dir_of_another_program_exits_2_naming_what_is_there_and_is_left_as_it_was(tmp_path, fbank):
    for folder, holds in foreign_folders(tmp_path):
        before = tree(folder)
        r = trainer_in_process(["--data_dir", fbank, "--output_dir", folder, *QUICK, "--max_steps", 2])
        assert r.returncode == 2, r.stderr[-3000:]
        assert (f"--output_dir {folder} is not a run of this trainer: it holds {holds}. Give an empty or new "
                "folder, or the --output_dir of one of this trainer's runs") in r.stderr, r.stderr[-3000:]
        assert tree(folder) == before and not (folder / LOCK_FILE).exists()


@pytest.mark.timeout(60)
def test_a_run_from_before_the_marker_is_recognised_and_a_refused_start_puts_its_folder_back(tmp_path):
    """A run folder written before the marker existed (config.json of this trainer, or only a run's own files)
    is taken: it gets the marker. A start refused later (abandon) takes the marker away again and puts back
    the lock file it found, bytes and time."""
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    save_config(parse_args(["--output_dir", str(legacy)]), legacy / "config.json")
    (legacy / "checkpoints" / "step_00000004.pt").write_bytes(b"weights")
    (legacy / "metrics.jsonl").write_text("{}\n")
    (legacy / LOCK_FILE).write_text('{"pid": 1}\n')
    no_config = tmp_path / "killed_early"  # killed before its config.json: a lock file and a lengths manifest
    no_config.mkdir()
    (no_config / LOCK_FILE).write_text("")
    (no_config / "lengths_0123456789abcdef.npz").write_bytes(b"")
    for folder in (legacy, no_config, tmp_path / "new" / "run"):
        before = tree(folder) if folder.exists() else None
        lock = OutputDirLock(folder, rank=0).take()
        assert lock.error is None and (folder / MARKER).exists()
        lock.abandon()
        assert (tree(folder) if folder.exists() else None) == before
    kept = OutputDirLock(legacy, rank=0).take()  # a start that goes on keeps its marker
    kept.release()
    assert (legacy / MARKER).exists() and OutputDirLock(legacy, rank=0).take().error is None


@pytest.mark.timeout(120)
def test_a_changed_codec_names_only_what_differs_and_its_fix_resumes(tmp_path, demo_run):
    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    flags = ["--output_dir", run, *QUICK, "--max_steps", 42]
    r = trainer_in_process([*flags, "--codebook_size", "64", "--quantize_dropout"])
    assert r.returncode == 2, r.stderr[-3000:]
    said = re.search(r"ERROR (checkpoint .*)", r.stderr).group(1)
    assert said == (f"checkpoint {run}/checkpoints/step_00000040.pt was trained with a codec that differs from "
                    "this run's flags: codebook_size 32 (this run: 64), quantize_dropout False (this run: True). To "
                    "continue it, run with --codebook_size 32 and without --quantize_dropout; to train this codec "
                    "from scratch, give another --output_dir")
    path = run / "checkpoints" / "step_00000040.pt"
    r = trainer_in_process(["--output_dir", tmp_path / "other", *QUICK, "--codebook_size", "64", "--resume", path])
    assert r.returncode == 2 and "to train this codec from scratch, give no --resume" in r.stderr
    r = run_trainer(flags)  # the fix: the flags the checkpoint trained with (TINY's --codebook_size 32)
    assert r.returncode == 0 and "resumed from" in r.stderr and "at step 40" in r.stderr, r.stderr[-3000:]
    assert newest(run)["step"] == 42


@pytest.mark.timeout(120)
def test_a_data_dir_of_audio_suggests_tools_extract_and_its_command_makes_features(tmp_path):
    audio = tmp_path / "audio"
    write_corpus(audio, [("spk1/a.wav", 1.0, 16000, 1), ("spk1/b.flac", 1.2, 16000, 1)])
    r = trainer_in_process(["--data_dir", audio, "--output_dir", tmp_path / "run", *QUICK])
    assert r.returncode == 2 and not (tmp_path / "run").exists(), r.stderr[-3000:]
    assert "It holds audio (spk1/a.wav): the trainer reads features; extract them first" in r.stderr
    command = re.search(r"`python -m (tools\.extract [^`]+)`, then give --data_dir (\S+)", r.stderr)
    module, *args = command.group(1).split()
    extract = run_module(module, *args, "--num_workers", "0")
    assert extract.returncode == 0, extract.stderr[-3000:]
    from data.stores import open_stores

    train, _, _ = open_stores(command.group(2), "train", "valid", seed=0)
    assert len(train) == 1 and train.dim == 160  # the other of the two is held out
