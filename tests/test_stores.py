import subprocess

import numpy as np
import pytest
import torch

from data.stores import find_split, open_stores
from errors import BadInputError
from tests.helpers import TINY, env, events, run_python, trainer_in_process, write_fairseq


def test_fairseq_dump_reads_every_shard_in_order(tmp_path):
    lengths = [40, 50, 60, 70, 80]
    utts = write_fairseq(tmp_path, "train", lengths, nshard=2)
    write_fairseq(tmp_path, "valid", [40, 40])
    train, valid, note = open_stores(tmp_path, "train", "valid", seed=0)
    assert note is None
    assert list(train.lengths) == lengths and train.dim == 16 and len(valid) == 2
    for i, u in enumerate(utts):
        np.testing.assert_array_equal(train.utterance(i), u)


def test_a_share_of_a_split_holds_only_the_sources_it_reads(tmp_path):
    utts = write_fairseq(tmp_path / "dump", "train", [40, 50, 60, 70, 80, 90], nshard=3)  # 2 utterances a shard
    split = find_split(tmp_path / "dump", "train")
    share = split.share(3, 5)  # the second utterance of shard 1, the first of shard 2
    assert list(share.lengths) == [70, 80] and len(share.sources) == 2
    assert "utterances 3-4" in share.description
    for i, u in enumerate(utts[3:5]):
        np.testing.assert_array_equal(share.utterance(i), u)
    (tmp_path / "files").mkdir()
    for i, u in enumerate(utts):
        np.save(tmp_path / "files" / f"u{i}.npy", u)
    files = find_split(tmp_path, "files").share(1, 3)  # a folder store: only these files
    assert [p.name for p in files.sources] == ["u1.npy", "u2.npy"]
    np.testing.assert_array_equal(files.utterance(1), utts[2])


def test_directory_of_npy_and_pt_with_holdout(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(100):
        a = rng.standard_normal((30 + i, 8)).astype(np.float32)
        if i % 2:
            np.save(tmp_path / f"u{i:03d}.npy", a)
        else:
            torch.save(torch.from_numpy(a), tmp_path / f"u{i:03d}.pt")
    train, valid, note = open_stores(tmp_path, "train", "valid", seed=3)
    assert len(train) == 98 and len(valid) == 2
    assert "holding out 2 of 100" in note
    again = open_stores(tmp_path, "train", "valid", seed=3)[1]
    assert [valid.name(i) for i in range(2)] == [again.name(i) for i in range(2)]


def test_split_subfolders(tmp_path):
    for split, n in (("train", 5), ("valid", 2)):
        (tmp_path / split).mkdir()
        for i in range(n):
            np.save(tmp_path / split / f"{i}.npy", np.zeros((20, 4), np.float32))
    train, valid, _ = open_stores(tmp_path, "train", "valid", seed=0)
    assert (len(train), len(valid)) == (5, 2)


@pytest.mark.parametrize("case", ["missing", "empty", "bad_len", "len_not_numbers", "mixed_dims", "missing_shard",
                                  "not_2d"])
def test_bad_stores_are_named(tmp_path, case):
    d = tmp_path / "data"
    if case != "missing":
        d.mkdir()
    if case == "bad_len":
        write_fairseq(d, "train", [10, 20])
        (d / "train_0_1.len").write_text("10\n25\n")
    elif case == "len_not_numbers":
        write_fairseq(d, "train", [10, 20])
        (d / "train_0_1.len").write_text("10\ntwenty\n")
    elif case == "mixed_dims":
        np.save(d / "a.npy", np.zeros((10, 8), np.float32))
        np.save(d / "b.npy", np.zeros((10, 9), np.float32))
    elif case == "missing_shard":
        write_fairseq(d, "train", [10, 20, 30], nshard=3)
        (d / "train_1_3.npy").unlink()
    elif case == "not_2d":
        np.save(d / "a.npy", np.zeros((10,), np.float32))
    with pytest.raises(BadInputError) as info:
        open_stores(d, "train", "valid", seed=0)
    expected = {"missing": "does not exist", "empty": "no training features", "bad_len": "lists 35 frames",
                "len_not_numbers": "train_0_1.len: every line must be a whole number",
                "mixed_dims": "feature dims differ", "missing_shard": "train_1_3.npy", "not_2d": "[T, D]"}[case]
    assert expected in str(info.value)


def test_a_fairseq_dump_is_never_read_as_utterance_files_but_files_named_like_shards_are(tmp_path):
    dump = tmp_path / "dump"
    write_fairseq(dump, "train", [40, 50])
    write_fairseq(dump, "valid", [40])
    assert find_split(dump, "foo", loose_files=True) is None
    with pytest.raises(BadInputError, match="no split 'foo' in .*'train', 'valid': give one of them to --train_split"):
        open_stores(dump, "foo", "valid", seed=0)
    assert not (dump / ".lengths.npz").exists()
    loose = tmp_path / "loose"  # utterance files whose names look like shards, with no .len: utterances
    loose.mkdir()
    for name in ("spk_1_2.npy", "spk_2_2.npy", "spk_3_2.npy"):
        np.save(loose / name, np.zeros((40, 4), np.float32))
    assert len(find_split(loose, "train")) == 3


def run_check(*args) -> subprocess.CompletedProcess:
    return run_python(["-m", "tools.check", *args], timeout=120, env=env())


def test_check_names_every_non_finite_utterance_and_exits_2(tmp_path):
    utts = write_fairseq(tmp_path, "train", [10, 20, 30, 40])
    arr = np.concatenate(utts)
    arr[10 + 5, 3] = np.nan
    arr[60 + 2, 0] = np.inf
    np.save(tmp_path / "train_0_1.npy", arr)
    r = run_check(tmp_path)
    assert r.returncode == 2, r.stderr
    assert "train_0_1.npy utterance 1 (rows 10-30)" in r.stderr and "train_0_1.npy utterance 3 (rows 60-100)" in r.stderr
    assert "2 with non-finite values" in r.stderr and "finished successfully" not in r.stderr
    # a dump from tools.extract has its audio files in the .tsv beside it: messages name them
    (tmp_path / "train_0_1.tsv").write_text("/audio\n" + "".join(f"spk/utt{i:04d}.wav\t{n * 320}\n"
                                                              for i, n in enumerate([10, 20, 30, 40])))
    r = run_check(tmp_path)
    assert "train_0_1.npy utterance 3 (rows 60-100, audio /audio/spk/utt0003.wav)" in r.stderr, r.stderr
    # sharded like the trainer: rank 0 of 2 owns utterances 0 and 2, both finite
    r = run_check(tmp_path, "--nshard", 2, "--rank", 0)
    assert r.returncode == 0 and "2 of 4 utterances" in r.stderr and "finished successfully" in r.stderr


def test_check_of_a_clean_split_and_of_a_missing_one(tmp_path):
    write_fairseq(tmp_path, "valid", [10, 20])
    r = run_check(tmp_path, "--split", "valid")
    assert r.returncode == 0 and "finished successfully" in r.stderr, r.stderr
    r = run_check(tmp_path, "--split", "test")
    assert r.returncode == 2 and "no split 'test'" in r.stderr


def test_check_of_a_training_runs_folder_names_the_features_it_trained_on(tmp_path, caplog):
    """A run's --output_dir given to tools.check: its checkpoints/ of .pt files is no split of utterances; the
    message says it is a run and names the run's --data_dir, or the demo corpus, for a run from before the marker
    too."""
    from tools import check
    from training.config import parse_args, save_config
    from training.run_folder import RunFolder

    run = RunFolder(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    (run.checkpoints / "step_00000004.pt").write_bytes(b"weights")
    run.marker.write_text("{}\n")
    feats = tmp_path / "my feats"
    save_config(parse_args(["--output_dir", str(run.root), "--data_dir", str(feats)]), run.config)
    assert check.main([str(run.root), "--split", "valid"]) == 2
    assert (f"{run.root} is a training run (the trainer's --output_dir), not a folder of features: check the "
            f"features it trained on, its --data_dir: python -m tools.check '{feats}' --split valid") in caplog.text
    run.marker.unlink()
    save_config(parse_args(["--output_dir", str(run.root)]), run.config)
    caplog.clear()
    assert check.main([str(run.root)]) == 2
    assert "is a training run (the trainer's --output_dir), not a folder of features; it trained on the built-in " \
           "demo corpus" in caplog.text and "'checkpoints'" not in caplog.text


def test_a_folder_store_reads_its_files_once_then_only_its_lengths_manifest(tmp_path, monkeypatch):
    import data.stores as stores

    (tmp_path / "train").mkdir()
    for i, n in enumerate([30, 40, 50]):
        np.save(tmp_path / "train" / f"u{i}.npy", np.zeros((n, 4), np.float32))
    assert list(find_split(tmp_path, "train").lengths) == [30, 40, 50]
    assert (tmp_path / "train" / stores.MANIFEST_NAME).exists()
    with monkeypatch.context() as m:
        m.setattr(stores, "_load_array", lambda path: pytest.fail(f"{path} opened at start"))
        again = find_split(tmp_path, "train")
    assert list(again.lengths) == [30, 40, 50] and again.dim == 4
    np.save(tmp_path / "train" / "u3.npy", np.zeros((60, 4), np.float32))  # a new file: all are read again
    assert list(find_split(tmp_path, "train").lengths) == [30, 40, 50, 60]


def test_a_held_out_split_that_is_the_training_split_draws_a_warning(tmp_path, caplog):
    for split in ("train", "valid"):
        (tmp_path / split).mkdir()
        for i in range(3):
            np.save(tmp_path / split / f"u{i}.npy", np.zeros((30, 4), np.float32))
    open_stores(tmp_path, "train", "valid", seed=0)
    assert "scores on the training data" not in caplog.text
    open_stores(tmp_path, "train", "train", seed=0)
    assert "--train_split and --valid_split both name 'train': the held-out figures" in caplog.text


def test_a_file_written_again_after_its_lengths_manifest_is_named_with_the_manifest_to_delete(tmp_path):
    """A file fixed in place (as tools.check advises) keeps its name, so the lengths manifest still matches the
    folder: reading it names the file and the manifest to delete, rather than failing in a crop's copy."""
    import data.stores as stores

    (tmp_path / "train").mkdir()
    for i, n in enumerate([30, 40]):
        np.save(tmp_path / "train" / f"u{i}.npy", np.zeros((n, 4), np.float32))
    find_split(tmp_path, "train")
    np.save(tmp_path / "train" / "u1.npy", np.zeros((25, 4), np.float32))
    store = find_split(tmp_path, "train")
    assert store.utterance(0).shape == (30, 4)
    with pytest.raises(BadInputError, match=r"u1\.npy has shape \(25, 4\), its folder's \.lengths\.npz says "
                                            r"\(40, 4\): the file was written again since; delete .*\.lengths\.npz"):
        store.utterance(1)
    (tmp_path / "train" / stores.MANIFEST_NAME).unlink()
    assert find_split(tmp_path, "train").utterance(1).shape == (25, 4)


def test_a_read_only_folder_keeps_its_manifest_in_the_output_dir_once_the_data_pass(tmp_path, monkeypatch):
    import data.stores as stores
    from data.training_data import DataConfig, open_training_data

    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    for i in range(6):
        np.save(data / "train" / f"u{i}.npy", np.zeros((64 + i, 4), np.float32))
    monkeypatch.setattr(stores.os, "access", lambda path, mode: False)  # as a read-only mount
    cfg = DataConfig(data_dir=str(data), segment_length=32, batch_size=2)
    with pytest.raises(BadInputError):  # a check that fails after the folder was read: nothing written
        open_training_data(DataConfig(data_dir=str(data), segment_length=128), rank=0, world_size=1, seed=0,
                           multiple_of=1, device_type="cpu", manifest_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    open_training_data(cfg, rank=0, world_size=1, seed=0, multiple_of=1, device_type="cpu", manifest_dir=tmp_path / "out")
    assert not (data / "train" / stores.MANIFEST_NAME).exists() and len(list((tmp_path / "out").glob("*.npz"))) == 1
    monkeypatch.setattr(stores, "_load_array", lambda path: pytest.fail(f"{path} opened at start"))
    again = open_training_data(cfg, rank=0, world_size=1, seed=0, multiple_of=1, device_type="cpu", manifest_dir=tmp_path / "out")
    assert again.train.total_frames + again.eval.store.total_frames == sum(64 + i for i in range(6))


@pytest.mark.slow
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
