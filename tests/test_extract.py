"""tools.extract: audio -> a fairseq dump of Seamless features that the trainer reads."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest


import soundfile as sf
import soxr
from transformers import SeamlessM4TFeatureExtractor

from tools import extract
from data.manifests import read_manifest
from data.stores import find_split
from errors import BadInputError
from tests import audio_helpers
from tests.audio_helpers import CORPUS, voice_like, write_corpus

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


def utterances(out_dir: Path, name: str) -> list[np.ndarray]:
    array = np.load(out_dir / f"{name}.npy")
    lengths = [int(n) for n in (out_dir / f"{name}.len").read_text().split()]
    assert sum(lengths) == array.shape[0]
    return np.split(array, np.cumsum(lengths)[:-1])


def manifest_entries(path: Path) -> list[str]:
    return [line.split("\t")[0] for line in path.read_text().splitlines()[1:]]


def seamless_reference(path: Path) -> np.ndarray:
    """What SeamlessM4TFeatureExtractor gives for a file: mono average, soxr to 16 kHz, valid frames only."""
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != 16000:
        wave = soxr.resample(wave, rate, 16000).astype(np.float32)
    out = SeamlessM4TFeatureExtractor()(wave, sampling_rate=16000, return_tensors="np")
    return out["input_features"][0, : int(out["attention_mask"][0].sum())]


def test_fbank_dump_equals_the_seamless_feature_extractor(tmp_path):
    audio = tmp_path / "audio"
    relpaths = write_corpus(audio)
    assert extract.main([audio, "train", 1, 0, tmp_path / "feats", "--feature", "fbank"]) == 0
    feats = tmp_path / "feats"
    got = utterances(feats, "train_0_1")
    assert manifest_entries(feats / "train_0_1.tsv") == relpaths
    assert (feats / "train_0_1.tsv").read_text().splitlines()[0] == str(audio.resolve())
    for rel, features in zip(relpaths, got, strict=True):
        assert features.dtype == np.float32 and features.shape[1] == 160
        # the torch front-end (the default) gives the extractor's numbers within 1e-4
        np.testing.assert_allclose(features, seamless_reference(audio / rel), rtol=0, atol=1e-4, err_msg=rel)
    # 16 kHz PCM: the same numbers as the extractor on the file's own samples, frame count floor(raw frames / 2)
    wave, _ = sf.read(str(audio / "a00.wav"), dtype="float32")
    assert len(got[0]) == (1 + (len(wave) - 400) // 160) // 2
    note = json.loads((feats / "train_0_1.json").read_text())
    assert note["feature"] == "fbank" and note["dim"] == 160 and note["utterances"] == len(relpaths)
    assert note["front_end"] == "torch"
    assert (feats / "train_0_1.skipped").read_text() == ""
    assert not list(feats.glob("*.tmp"))
    store = find_split(feats, "train")  # what the trainer reads
    assert store.dim == 160 and list(store.lengths) == [len(f) for f in got]


def test_the_log_accounts_for_the_time_of_the_models_thread_and_of_the_writer(tmp_path, caplog):
    """Where a shard's time went, by stage: the model's thread's shares add up to at most the whole, and the writer
    wrote."""
    import re

    audio = tmp_path / "audio"
    write_corpus(audio)
    assert extract.main([audio, "train", 1, 0, tmp_path / "feats", "--feature", "fbank", "--commit_files", "3"]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("time on the model's thread: "))
    model, writer = line.split("; on the writer's: ")
    shares = {name: int(share) for share, name in re.findall(r"(\d+)% ([a-z ]+)", model)}
    assert set(shares) <= {"waiting for decoded audio", "fbank", "passes", "codec", "waiting for the writer"}, line
    assert sum(shares.values()) <= 101, line
    assert "writing" in writer, line


def test_float16_dump_holds_the_float32_features_rounded(tmp_path):
    audio = tmp_path / "audio"
    write_corpus(audio)
    assert extract.main([audio, "train", 1, 0, tmp_path / "f32", "--feature", "fbank"]) == 0
    assert extract.main([audio, "train", 1, 0, tmp_path / "f16", "--feature", "fbank", "--dtype", "float16"]) == 0
    full, half = np.load(tmp_path / "f32" / "train_0_1.npy"), np.load(tmp_path / "f16" / "train_0_1.npy")
    assert half.dtype == np.float16 and half.nbytes * 2 == full.nbytes
    np.testing.assert_array_equal(half, full.astype(np.float16))
    assert json.loads((tmp_path / "f16" / "train_0_1.json").read_text())["dtype"] == "float16"
    store = find_split(tmp_path / "f16", "train")
    assert store.dtype == np.float16 and list(store.lengths) == list(find_split(tmp_path / "f32", "train").lengths)


def test_manifest_shards_are_contiguous_and_cover_every_file(tmp_path):
    audio = tmp_path / "audio"
    relpaths = write_corpus(audio)[:5]
    manifest = tmp_path / "train.tsv"
    manifest.write_text(f"{audio}\n" + "".join(f"{rel}\t{sf.info(str(audio / rel)).frames}\n" for rel in relpaths))
    assert extract.main([manifest, "train", 1, 0, tmp_path / "whole"]) == 0
    for rank in (0, 1):
        assert extract.main([manifest, "train", 2, rank, tmp_path / "sharded"]) == 0
    assert manifest_entries(tmp_path / "sharded" / "train_0_2.tsv") == relpaths[:2]  # round(5 / 2 * 1) = 2
    assert manifest_entries(tmp_path / "sharded" / "train_1_2.tsv") == relpaths[2:]
    whole, sharded = find_split(tmp_path / "whole", "train"), find_split(tmp_path / "sharded", "train")
    assert len(sharded) == len(whole) == 5
    for i in range(5):
        np.testing.assert_array_equal(sharded.utterance(i), whole.utterance(i))


def test_bad_files_are_skipped_named_and_counted(tmp_path, caplog):
    audio = tmp_path / "audio"
    write_corpus(audio, [("good1.wav", 1.0, 16000, 1), ("good2.flac", 1.5, 22050, 1)])
    good = (audio / "good1.wav").read_bytes()
    (audio / "text.wav").write_text("this is a text file, not audio\n" * 20)
    (audio / "empty.wav").write_bytes(b"")
    (audio / "header_cut.wav").write_bytes(good[:30])
    (audio / "data_cut.wav").write_bytes(good[: len(good) // 2])
    sf.write(audio / "no_samples.wav", np.zeros(0, np.float32), 16000)
    sf.write(audio / "too_short.wav", voice_like(0.02, 16000, 0), 16000)
    out = tmp_path / "feats"
    assert extract.main([audio, "train", 1, 0, out]) == 0
    skipped = dict(line.split("\t") for line in (out / "train_0_1.skipped").read_text().splitlines())
    assert set(skipped) == {"text.wav", "empty.wav", "header_cut.wav", "data_cut.wav", "no_samples.wav",
                            "too_short.wav"}
    assert "unreadable" in skipped["text.wav"] and "empty" in skipped["empty.wav"]
    assert "truncated" in skipped["data_cut.wav"] and "too short" in skipped["too_short.wav"]
    assert manifest_entries(out / "train_0_1.tsv") == ["good1.wav", "good2.flac"]
    assert len(utterances(out, "train_0_1")) == 2
    assert json.loads((out / "train_0_1.json").read_text())["skipped"] == 6
    assert "skipped header_cut.wav" in caplog.text and "skipped 6 file(s)" in caplog.text
    assert "finished successfully" in caplog.text

    # nothing extractable: exit 1, nothing written
    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    (only_bad / "x.wav").write_text("not audio")
    assert extract.main([only_bad, "train", 1, 0, tmp_path / "none"]) == 1
    assert [p.name for p in (tmp_path / "none").iterdir()] == [".train_0_1.lock"]  # the writer lock's file alone


def test_a_skipped_file_is_named_as_it_is_skipped_not_at_the_shards_end(tmp_path, caplog, monkeypatch):
    """A run stopped after the window of an unreadable file (here by an error before its second commit) has
    already named it: a large shard's end may be hours off, or never come."""
    audio = tmp_path / "audio"
    write_corpus(audio, [("b1.wav", 1.0, 16000, 1), ("b2.wav", 1.0, 16000, 1)])
    (audio / "a_text.wav").write_text("this is a text file, not audio\n" * 20)  # the first file listed

    class StopAtTheSecondCommit:
        def before_commit(self, number):
            if number == 2:
                raise RuntimeError("stopped before the second commit")

    monkeypatch.setattr(extract, "FaultInjector", lambda rank: StopAtTheSecondCommit())
    with pytest.raises(RuntimeError, match="second commit"):
        extract.main([audio, "train", 1, 0, tmp_path / "feats", "--commit_files", 1, "--num_workers", 0])
    assert "skipped a_text.wav: unreadable" in caplog.text
    assert (tmp_path / "feats" / "train_0_1.skipped.partial").read_text().startswith("a_text.wav\tunreadable")


def test_empty_or_missing_input_exits_2(tmp_path, caplog):
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "root_only.tsv").write_text(f"{tmp_path}\n")
    (tmp_path / "no_audio").mkdir()
    cases = {"empty.tsv": "is empty", "root_only.tsv": "lists no files", "no_audio": "no audio files",
             "missing.tsv": "does not exist"}
    for name, message in cases.items():
        caplog.clear()
        assert extract.main([tmp_path / name, "train", 1, 0, tmp_path / "out"]) == 2, name
        assert message in caplog.text, name
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:
        extract.main([tmp_path / "empty.tsv", "train", 2, 2, tmp_path / "out"])  # rank out of range
    assert e.value.code == 2


@pytest.mark.parametrize("device", ["tpu", "cuda:99"])  # not a device; a GPU no machine here has
def test_a_bad_device_exits_2_with_nothing_written(tmp_path, caplog, device):
    """--device is resolved before the shard is claimed: its lock, progress and partial files are never made."""
    audio = tmp_path / "audio"
    write_corpus(audio, [("a.wav", 1.0, 16000, 1)])
    assert extract.main([audio, "train", 1, 0, tmp_path / "out", "--device", device]) == 2
    assert f"--device {device}" in caplog.text
    assert not (tmp_path / "out").exists()


def crash_at_call(patch: pytest.MonkeyPatch, n: int) -> None:
    """The fbank front-end raising at its n-th file: a run that crashes midway."""
    real, calls = extract.SeamlessFbank.__call__, []

    def failing(self, wave):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("simulated crash")
        return real(self, wave)

    patch.setattr(extract.SeamlessFbank, "__call__", failing)


def test_a_crash_midway_leaves_no_file_the_trainer_could_read(tmp_path, monkeypatch):
    audio = tmp_path / "audio"
    write_corpus(audio)
    crash_at_call(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract.main([audio, "train", 1, 0, tmp_path / "feats", "--num_workers", 0, "--commit_files", 2])
    assert find_split(tmp_path / "feats", "train") is None  # one commit made: partial files, no dump
    assert sorted(p.name for p in (tmp_path / "feats").iterdir() if not p.name.endswith(".partial")) == \
        [".train_0_1.lock", "train_0_1.progress"]


def test_a_relative_manifest_root_is_written_absolute_and_a_shard_begun_relative_is_refused(tmp_path, monkeypatch,
                                                                                             caplog):
    audio = tmp_path.resolve() / "corpus" / "audio"  # as the working directory names it
    relpaths = write_corpus(audio)
    (tmp_path / "corpus" / "train.tsv").write_text("audio\n" + "".join(f"{rel}\t1\n" for rel in relpaths))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "feats"
    args = [Path("corpus/train.tsv"), "train", 1, 0, out, "--num_workers", 0, "--commit_files", 2]
    with monkeypatch.context() as patch:  # a shard begun by a version that recorded the root as given: relative
        crash_at_call(patch, 4)
        with pytest.raises(RuntimeError, match="simulated crash"):
            extract.main(args)
    progress = json.loads((out / "train_0_1.progress").read_text())
    assert progress["done"] == 2 and progress["settings"]["root"] == str(audio)
    progress["settings"]["root"] = "corpus/audio"
    (out / "train_0_1.progress").write_text(json.dumps(progress))
    shard = lambda: {p.name: p.read_bytes() for p in out.glob("train_0_1.*")}  # noqa: E731
    before = shard()
    assert extract.main(args) == 2
    assert f"was begun with other settings (root: 'corpus/audio' -> '{audio}')" in caplog.text
    assert "--overwrite" in caplog.text and shard() == before
    assert extract.main([*args, "--overwrite"]) == 0
    monkeypatch.chdir(audio)  # the .tsv written is a manifest of the same files from any working directory
    assert (out / "train_0_1.tsv").read_text().split("\n")[0] == str(audio)
    assert read_manifest(out / "train_0_1.tsv") == (audio, relpaths)


def test_a_link_to_nothing_in_a_folder_is_counted_and_skipped_as_missing(tmp_path, monkeypatch, caplog):
    audio, out = tmp_path / "audio", tmp_path / "feats"
    relpaths = write_corpus(audio)
    args = [audio, "train", 1, 0, out, "--num_workers", 0, "--commit_files", 2]
    with monkeypatch.context() as patch:  # a shard begun before the link was there (or by a version not listing it)
        crash_at_call(patch, 4)
        with pytest.raises(RuntimeError, match="simulated crash"):
            extract.main(args)
    (audio / "broken.wav").symlink_to(tmp_path / "nowhere.wav")
    assert extract.main(args) == 2  # its file list differs: refused, not resumed over other files
    assert "was begun with other settings (files: 10 -> 11, file_list: 'sha256:" in caplog.text
    assert extract.main([*args, "--overwrite"]) == 0
    assert "files 0-10 of 11" in caplog.text
    assert (out / "train_0_1.skipped").read_text() == "broken.wav\tmissing: no such file\n"
    assert manifest_entries(out / "train_0_1.tsv") == relpaths
    assert json.loads((out / "train_0_1.json").read_text())["skipped"] == 1


@pytest.fixture(scope="module")
def tiny_w2v_bert(tmp_path_factory):
    return audio_helpers.tiny_w2v_bert(tmp_path_factory.mktemp("w2v_bert"))


def test_w2v_bert_layer_matches_the_model_chunk_by_chunk(tmp_path, tiny_w2v_bert):
    import torch
    from transformers import Wav2Vec2BertModel

    audio = tmp_path / "audio"
    relpaths = write_corpus(audio, CORPUS[:4])  # 1 to 3 s: one to three chunks each
    out = tmp_path / "feats"
    assert extract.main([audio, "train", 1, 0, out, "--feature", "w2v-bert", "--checkpoint", tiny_w2v_bert,
                         "--layer", 1, "--max_chunk_seconds", 1.0, "--batch_seconds", 3, "--device", "cpu"]) == 0
    got = utterances(out, "train_0_1")
    model = Wav2Vec2BertModel.from_pretrained(str(tiny_w2v_bert), local_files_only=True).eval()
    for rel, features in zip(relpaths, got, strict=True):
        fbank = seamless_reference(audio / rel)
        assert features.shape == (len(fbank), 32)
        pieces = np.array_split(fbank, int(np.ceil(len(fbank) / 50)))  # 1 s chunks of at most 50 frames, equal
        with torch.no_grad():
            want = np.concatenate([model(input_features=torch.from_numpy(p)[None], output_hidden_states=True)
                                   .hidden_states[1][0].numpy() for p in pieces])
        np.testing.assert_allclose(features, want, rtol=1e-4, atol=1e-4, err_msg=rel)
    note = json.loads((out / "train_0_1.json").read_text())
    assert note["feature"] == "w2v-bert" and note["dim"] == 32 and note["layer"] == 1


def test_w2v_bert_bad_checkpoint_or_layer_exits_2(tmp_path, tiny_w2v_bert, caplog, capsys):
    audio = tmp_path / "audio"
    write_corpus(audio, [("a.wav", 1.0, 16000, 1)])
    assert extract.main([audio, "train", 1, 0, tmp_path / "o", "--feature", "w2v-bert", "--checkpoint",
                         tiny_w2v_bert, "--layer", 3]) == 2
    assert "--layer 3 is out of range" in caplog.text
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "seamless_m4t_v2"}))
    assert extract.main([audio, "train", 1, 0, tmp_path / "o", "--feature", "w2v-bert", "--checkpoint", other,
                         "--layer", 1]) == 2
    assert "not 'wav2vec2-bert'" in caplog.text
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as e:
        extract.main([audio, "train", 1, 0, tmp_path / "o", "--feature", "w2v-bert"])  # no --checkpoint/--layer
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # chunks of a frame or two: no context to encode them with
        extract.main([audio, "train", 1, 0, tmp_path / "o", "--feature", "w2v-bert", "--checkpoint", other,
                      "--layer", 1, "--max_chunk_seconds", 0.01])
    assert e.value.code == 2 and "--max_chunk_seconds must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_shards_of_a_split_must_be_cut_from_one_listing_of_the_source(tmp_path, caplog):
    """Ranks started on several machines while files still arrive list the source differently: rank 0 cut from 6
    files, rank 1 from 10, and the files between their shares would be in no shard. The second rank exits 2 before
    writing; shards that both began (no check could see the other) are refused by their readers."""
    audio, out = tmp_path / "audio", tmp_path / "out"
    write_corpus(audio, CORPUS[:6])
    assert extract.main([audio, "train", 2, 0, out, "--num_workers", 0]) == 0
    write_corpus(audio, CORPUS)  # the rest arrives
    caplog.clear()
    assert extract.main([audio, "train", 2, 1, out, "--num_workers", 0]) == 2
    assert "train_0_2 was cut from another list of the source than train_1_2 (6 file(s) there, 10 file(s) here)" \
        in caplog.text
    assert sorted(p.name for p in out.glob("train_1_2*")) == []
    # written side by side (elsewhere, then put together): the readers refuse the split
    assert extract.main([audio, "train", 2, 1, tmp_path / "late", "--num_workers", 0]) == 0
    for path in (tmp_path / "late").glob("train_1_2.*"):
        path.rename(out / path.name)
    with pytest.raises(BadInputError, match=r"split 'train' was written from two listings of its audio "
                                            r"\(train_0_2\.npy and train_1_2\.npy: 6 file\(s\) there, 10"):
        find_split(out, "train")
    # the same count, other names: a file renamed between the two starts
    assert extract.main([audio, "train", 2, 0, tmp_path / "renamed", "--num_workers", 0]) == 0
    (audio / "a00.wav").rename(audio / "a00b.wav")
    caplog.clear()
    assert extract.main([audio, "train", 2, 1, tmp_path / "renamed", "--num_workers", 0]) == 2
    assert "(10 file(s) on both, named otherwise)" in caplog.text


def test_a_shard_finished_before_shards_recorded_their_source_is_still_complete(tmp_path, caplog):
    """A shard written before `source_listing` was recorded is held to the settings it has: the same command
    finds it complete, and the shards beside it are not compared with it."""
    audio, out = tmp_path / "audio", tmp_path / "out"
    write_corpus(audio, CORPUS[:4])
    assert extract.main([audio, "train", 2, 0, out, "--num_workers", 0]) == 0
    meta = json.loads((out / "train_0_2.json").read_text())
    del meta["source_listing"]
    (out / "train_0_2.json").write_text(json.dumps(meta))
    caplog.clear()
    assert extract.main([audio, "train", 2, 0, out, "--num_workers", 0]) == 0
    assert "is complete" in caplog.text
    assert extract.main([audio, "train", 2, 1, out, "--num_workers", 0]) == 0
    assert find_split(out, "train") is not None
