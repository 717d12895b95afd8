"""Audio to codes at scale: extraction and tokenization that commit and resume, tokenize = extract + encode,
one writer per shard, nothing replaced by mistake. Real audio the test makes, real processes where it matters."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from data.audio import pass_plan
from data.dump_writer import publish, shard_range
from data.resumable_shard import ShardWriter
from models.codes import km_lines
from rvq_tokenizer.codec_files import load_codec
from tests.audio_helpers import CORPUS, codec_checkpoint, random_codec, tiny_w2v_bert, write_corpus
from tests.helpers import REPO, TINY, _state, env, run_trainer, tree
from tools import encode, evaluate, export, extract, report, tokenize

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHARD = "train_0_1"
COMMIT = ["--commit_files", 2]  # 7 files (one of them bad): 4 commits
W2V = ["--feature", "w2v-bert", "--layer", 1, "--max_chunk_seconds", 1.0, "--batch_seconds", 2.5, "--device", "cpu"]
EXTRACTED = (".npy", ".len", ".tsv", ".skipped", ".json")
CODES = (".codes.npy", ".codes.len", ".codes.tsv", ".km")


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six files and a bad one, in a manifest; their fbank dump and a codec trained on it by the trainer; a tiny
    w2v-BERT's dump and an untrained codec that records it; each tokenized, and extracted then encoded."""
    root = tmp_path_factory.mktemp("audio_to_codes")
    c = SimpleNamespace(root=root, audio=root / "audio", manifest=root / "train.tsv")
    good = write_corpus(c.audio, CORPUS[:6])
    (c.audio / "bad.wav").write_text("not audio\n" * 20)
    c.files = good[:3] + ["bad.wav"] + good[3:]
    samples = {rel: sf.info(str(c.audio / rel)).frames for rel in good}
    c.manifest.write_text(f"{c.audio}\n" + "".join(f"{rel}\t{samples.get(rel, 1)}\n" for rel in c.files))
    c.w2v = tiny_w2v_bert(root / "w2v_bert")
    c.fbank_feats, c.w2v_feats = root / "fbank_feats", root / "w2v_feats"
    assert extract.main([c.manifest, "train", 1, 0, c.fbank_feats, *COMMIT]) == 0
    assert extract.main([c.manifest, "train", 1, 0, c.w2v_feats, *COMMIT, *W2V, "--checkpoint", c.w2v]) == 0
    c.fbank_run = root / "fbank_run"
    r = run_trainer(["--data_dir", c.fbank_feats, "--output_dir", c.fbank_run, "--max_steps", 4, *TINY,
                     "--downsample", 2], timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    c.w2v_run = random_codec(root / "w2v_codec.pt", c.w2v_feats)
    for kind, feats, run, extra in (("fbank", c.fbank_feats, c.fbank_run, ["--km", 2]),
                                    ("w2v", c.w2v_feats, c.w2v_run, ["--km"])):
        assert encode.main(["--checkpoint", run, "--data_dir", feats, "--output_dir", root / f"{kind}_encoded",
                            *extra]) == 0
        assert tokenize.main([c.manifest, "train", 1, 0, root / f"{kind}_tokenized", "--checkpoint", run, *COMMIT,
                              "--batch_seconds", 2.5, *extra]) == 0
    return c


def files_of(folder: Path, name: str, exts) -> dict:
    return {ext: (folder / (name + ext)).read_bytes() for ext in exts}


@pytest.mark.parametrize("kind", ["fbank", "w2v"])
def test_tokenize_gives_the_codes_of_extract_then_encode_bit_for_bit(corpus, kind):
    c = corpus
    tokenized, encoded = c.root / f"{kind}_tokenized", c.root / f"{kind}_encoded"
    assert files_of(tokenized, SHARD, CODES) == files_of(encoded, SHARD, CODES)
    feats = c.fbank_feats if kind == "fbank" else c.w2v_feats
    # the bad file skipped and listed as the extractor lists it
    assert (tokenized / f"{SHARD}.codes.skipped").read_bytes() == (feats / f"{SHARD}.skipped").read_bytes()
    assert (tokenized / f"{SHARD}.codes.skipped").read_text().startswith("bad.wav\tunreadable")
    meta, want = (json.loads((d / f"{SHARD}.codes.json").read_text()) for d in (tokenized, encoded))
    assert meta["feature_frames"] == want["feature_frames"] and meta["utterances"] == want["utterances"] == 6
    assert meta["features"]["feature"] == ("fbank" if kind == "fbank" else "w2v-bert")
    assert not [p.name for p in tokenized.iterdir() if p.suffix in (".partial", ".progress", ".tmp")]


def test_a_km_file_has_a_line_per_utterance_with_a_unit_per_code_frame(corpus):
    for kind, level in (("fbank", 2), ("w2v", 1)):
        folder = corpus.root / f"{kind}_tokenized"
        codes = np.load(folder / f"{SHARD}.codes.npy")
        lengths = [int(n) for n in (folder / f"{SHARD}.codes.len").read_text().split()]
        lines = (folder / f"{SHARD}.km").read_text().splitlines()
        assert len(lines) == len(lengths) == 6
        assert [len(line.split()) for line in lines] == lengths
        units = np.array([int(u) for line in lines for u in line.split()])
        np.testing.assert_array_equal(units, codes[:, level - 1])


def test_the_trainer_records_the_features_and_export_reads_them(corpus, tmp_path):
    _, state, _ = load_codec(corpus.fbank_run)
    assert state["config"]["features"] == {"feature": "fbank", "dim": 160, "frame_rate_hz": 50, "sample_rate": 16000,
                                           "front_end": "torch", "precision": "float32", "dtype": "float32"}
    state["config"]["data_dir"] = str(tmp_path / "gone")  # the training data no longer there
    torch.save(state, tmp_path / "step_00000004.pt")
    assert export.main([tmp_path / "step_00000004.pt", tmp_path / "exported"]) == 0
    assert json.loads((tmp_path / "exported" / "codec.json").read_text())["feature"]["kind"] == "fbank"


def test_export_replaces_only_its_own_export_of_the_same_codec(corpus, tmp_path, caplog):
    out = tmp_path / "exported"
    assert export.main([corpus.fbank_run, out]) == 0
    first = (out / "codec.safetensors").read_bytes()
    assert export.main([corpus.fbank_run, out]) == 0  # the same codec again: written again, the same tensors
    assert (out / "codec.safetensors").read_bytes() == first
    other = codec_checkpoint(tmp_path / "other.pt", {"feature": "fbank", "dim": 160}, 160)
    cases = [  # (what out_dir holds, what the refusal names)
        ("another codec", "holds the export of another codec"),
        ("a foreign codec.json", "holds a codec.json that python -m tools.export did not write"),
        ("a foreign codec.safetensors", "holds a codec.safetensors that python -m tools.export did not write"),
    ]
    for held, message in cases:
        shutil.rmtree(out)
        out.mkdir()
        if held == "another codec":
            assert export.main([other, out]) == 0
        elif held == "a foreign codec.json":
            (out / "codec.json").write_text('{"mine": 1}\n')
        else:
            (out / "codec.safetensors").write_bytes(b"junk")
        before = tree(out)
        caplog.clear()
        assert export.main([corpus.fbank_run, out]) == 2, held
        assert message in caplog.text and "--overwrite" in caplog.text, (held, caplog.text)
        assert tree(out) == before, held  # nothing written
        assert export.main([corpus.fbank_run, out, "--overwrite"]) == 0, held
        assert (out / "codec.safetensors").read_bytes() == first, held
    caplog.clear()  # a kind the checkpoint contradicts; the checkpoint named as the command's argument
    assert export.main([corpus.fbank_run, tmp_path / "w2v", "--feature", "w2v-bert"]) == 2
    assert "--feature w2v-bert: the checkpoint says the codec was trained on fbank" in caplog.text
    assert not (tmp_path / "w2v").exists()
    caplog.clear()
    assert export.main([tmp_path / "w2v", tmp_path / "none"]) == 2
    assert "checkpoint " in caplog.text and "--checkpoint" not in caplog.text, caplog.text


def test_the_commands_take_an_exported_codec_as_they_take_its_run(corpus, tmp_path):
    c, exported = corpus, tmp_path / "exported"
    assert export.main([c.fbank_run, exported]) == 0
    with_export = ["--checkpoint", exported, "--km", 2]
    assert tokenize.main([c.manifest, "train", 1, 0, tmp_path / "tokenized", *with_export, *COMMIT,
                          "--batch_seconds", 2.5]) == 0
    assert files_of(tmp_path / "tokenized", SHARD, CODES) == files_of(c.root / "fbank_tokenized", SHARD, CODES)
    assert encode.main([*with_export, "--data_dir", c.fbank_feats, "--output_dir", tmp_path / "encoded"]) == 0
    assert files_of(tmp_path / "encoded", SHARD, CODES) == files_of(c.root / "fbank_encoded", SHARD, CODES)
    for codec, out in ((c.fbank_run, "from_run"), (exported, "from_export")):  # the run's codes, decoded by either
        assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", c.root / "fbank_encoded",
                            "--output_dir", tmp_path / out]) == 0
    decoded = [(tmp_path / out / f"{SHARD}.npy").read_bytes() for out in ("from_run", "from_export")]
    assert decoded[0] == decoded[1]
    scored = []
    for codec in (c.fbank_run, exported):
        assert evaluate.main(["--checkpoint", codec, "--data_dir", c.fbank_feats, "--split", "train",
                              "--json", tmp_path / "scores.json"]) == 0
        scored.append(json.loads((tmp_path / "scores.json").read_text())["rel_mse"])
    assert scored[0] == scored[1]


def test_a_codec_refuses_to_tokenize_other_features(corpus, tmp_path, caplog):
    c, out = corpus, tmp_path / "out"
    fbank_codec, w2v_codec = ["--checkpoint", c.fbank_run], ["--checkpoint", c.w2v_run]
    other = tiny_w2v_bert(tmp_path / "other_w2v_bert", seed=1)
    old = tmp_path / "old.pt"  # a checkpoint from before the trainer recorded its features
    state = torch.load(c.w2v_run, weights_only=False)
    torch.save({**state, "config": {}}, old)
    cases = [
        (fbank_codec + ["--feature", "w2v-bert"], ["trained on fbank", "ask for w2v-bert", "feature: 'fbank' -> "
                                                                                          "'w2v-bert'"]),
        (w2v_codec + ["--layer", 2], ["trained on w2v-bert layer 1", "layer: 1 -> 2"]),
        (w2v_codec + ["--precision", "bf16"], ["precision: 'float32' -> 'bfloat16'"]),
        (w2v_codec + ["--w2v_bert", other], ["trained on w2v-bert layer 1", f"--w2v_bert {other} gives", "model: "]),
        (["--checkpoint", old], ["trained on unknown features", "python -m tools.encode"]),
    ]
    for flags, messages in cases:
        caplog.clear()
        assert tokenize.main([c.manifest, "train", 1, 0, out, *flags]) == 2, flags
        for message in messages:
            assert message in caplog.text, (flags, message, caplog.text)
    assert not out.exists()


def test_bad_flags_exit_2_and_write_nothing(corpus, tmp_path, caplog):
    c, out = corpus, tmp_path / "out"
    for tool, flags in ((tokenize, ["--checkpoint", c.fbank_run]), (extract, [])):
        for bad in (["--commit_files", 0], ["--num_workers", -1], ["--batch_seconds", 0], ["--commit_seconds", -1]):
            with pytest.raises(SystemExit) as e:
                tool.main([c.manifest, "train", 1, 0, out, *flags, *bad])
            assert e.value.code == 2, (tool, bad)
        with pytest.raises(SystemExit) as e:
            tool.main([c.manifest, "train", 2, 2, out, *flags])  # rank out of range
        assert e.value.code == 2
        assert tool.main([c.root / "missing.tsv", "train", 1, 0, out, *flags]) == 2
        empty = next(r for r in range(8) if len(set(shard_range(len(c.files), 8, r))) == 1)
        assert tool.main([c.manifest, "train", 8, empty, out, *flags]) == 2 and "is empty" in caplog.text
    assert tokenize.main([c.manifest, "train", 1, 0, out, "--checkpoint", c.fbank_run, "--km", 3]) == 2
    assert "--km 3: the codes have levels 1 to 2" in caplog.text
    assert tokenize.main([c.manifest, "train", 1, 0, out, "--checkpoint", c.root / "nope"]) == 2
    assert not out.exists()


def killed_after_first_commit(module: str, args: list, out: Path, progress: str) -> dict:
    """Run `python -m module args` SIGKILLed between writing its second window and committing it."""
    killed = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                            timeout=120, cwd=REPO,  # the threads of this process: the same sums, the same bits
                            env=env(RVQ_FAULT="kill:step=2", OMP_NUM_THREADS=torch.get_num_threads()))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    committed = json.loads((out / progress).read_text())
    assert committed["done"] == 2 and committed["commits"] == 1
    return committed


def without_files(c, relpaths):
    """The committed files moved out of the audio folder: a rerun that read them again would skip them."""
    for rel in relpaths:
        (c.audio / rel).rename(c.audio / (rel + ".away"))
    return lambda: [(c.audio / (rel + ".away")).rename(c.audio / rel) for rel in relpaths]


def test_a_killed_extraction_resumes_to_the_bytes_of_one_never_stopped(corpus, tmp_path, caplog):
    c, out = corpus, tmp_path / "feats"
    args = [c.manifest, "train", 1, 0, out, *COMMIT, *W2V, "--checkpoint", c.w2v, "--num_workers", 1]
    killed_after_first_commit("tools.extract", args, out, f"{SHARD}.progress")
    assert not (out / f"{SHARD}.npy").exists()
    restore = without_files(c, c.files[:2])
    try:
        assert extract.main(args) == 0
    finally:
        restore()
    assert "resuming at file 2 of 7" in caplog.text and "bytes written after the last commit dropped" in caplog.text
    assert files_of(out, SHARD, EXTRACTED) == files_of(c.w2v_feats, SHARD, EXTRACTED)
    caplog.clear()  # a finished shard: nothing to do
    assert extract.main(args) == 0 and f"{SHARD} is complete" in caplog.text


def test_a_killed_tokenization_resumes_to_the_bytes_of_one_never_stopped(corpus, tmp_path, caplog):
    c, out = corpus, tmp_path / "codes"
    args = [c.manifest, "train", 1, 0, out, "--checkpoint", c.fbank_run, *COMMIT, "--batch_seconds", 2.5, "--km", 2,
            "--num_workers", 1]
    killed_after_first_commit("tools.tokenize", args, out, f"{SHARD}.codes.progress")
    restore = without_files(c, c.files[:2])
    try:
        assert tokenize.main(args) == 0
    finally:
        restore()
    assert "resuming at file 2 of 7" in caplog.text
    done = c.root / "fbank_tokenized"
    assert files_of(out, SHARD, (*CODES, ".codes.json", ".codes.skipped")) == \
        files_of(done, SHARD, (*CODES, ".codes.json", ".codes.skipped"))
    caplog.clear()  # other settings: refused, the finished shard kept
    assert tokenize.main([*args, "--beam_size", 1]) == 2 and "beam_size: 4 -> 1" in caplog.text
    assert files_of(out, SHARD, CODES) == files_of(done, SHARD, CODES)
    caplog.clear()  # another .km level: written from the finished codes, which are neither computed nor written
    km = args.index("--km")
    stamp = (out / f"{SHARD}.codes.npy").stat().st_mtime_ns
    assert tokenize.main([*args[:km], "--km", 1, *args[km + 2:]]) == 0
    assert "level 1, from the finished codes (it held level 2)" in caplog.text
    codes, lengths = np.load(out / f"{SHARD}.codes.npy"), (out / f"{SHARD}.codes.len").read_text().split()
    assert (out / f"{SHARD}.km").read_text() == km_lines(codes, np.array(lengths, dtype=np.int64), 1)
    assert (out / f"{SHARD}.codes.npy").stat().st_mtime_ns == stamp and json.loads(
        (out / f"{SHARD}.codes.json").read_text())["km_level"] == 1


def stopped(proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _state(proc.pid) != "T":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


def test_a_second_writer_of_a_shard_exits_2_at_once_and_the_first_finishes(corpus, tmp_path):
    """Two extractors on one shard, and two encoders: the second of each exits 2 naming the first, which was
    stopped (RVQ_FAULT hang) before its first commit holding the shard; the first then finishes, its files right."""
    c = corpus
    runs = {"extract": ["tools.extract", c.manifest, "train", 1, 0, tmp_path / "feats", *COMMIT],
            "encode": ["tools.encode", "--checkpoint", c.fbank_run, "--data_dir", c.fbank_feats, "--output_dir",
                       tmp_path / "codes", "--km", 2, "--commit_frames", 100]}
    firsts = {k: subprocess.Popen([sys.executable, "-m", *map(str, cmd)], cwd=REPO, env=env(RVQ_FAULT="hang:step=1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, cmd in runs.items()}
    try:
        for proc in firsts.values():
            stopped(proc, 90)
        before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.glob("*/*")}
        began = time.monotonic()
        seconds = {k: subprocess.Popen([sys.executable, "-m", *map(str, cmd)], cwd=REPO, env=env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for k, cmd in runs.items()}
        for k, proc in seconds.items():
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 2, err[-3000:]
            assert f"is being written by another process (pid {firsts[k].pid} on host" in err, err[-3000:]
        assert time.monotonic() - began < 60
        assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.glob("*/*")} == before  # untouched
        for proc in firsts.values():
            proc.send_signal(signal.SIGCONT)
        for k, proc in firsts.items():
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0 and "finished successfully" in err, err[-3000:]
    finally:
        for proc in firsts.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
    assert files_of(tmp_path / "feats", SHARD, EXTRACTED) == files_of(c.fbank_feats, SHARD, EXTRACTED)
    assert files_of(tmp_path / "codes", SHARD, CODES) == files_of(c.root / "fbank_encoded", SHARD, CODES)


def test_no_tool_replaces_output_it_did_not_write(corpus, tmp_path, caplog):
    c = corpus
    feats = tmp_path / "feats"
    shutil.copytree(c.fbank_feats, feats)
    before = files_of(feats, SHARD, EXTRACTED)
    one = tmp_path / "one"  # a mistyped source: one file
    write_corpus(one, CORPUS[:1])
    assert extract.main([one, "train", 1, 0, feats]) == 2
    assert "train_0_1.npy was written with other settings (root:" in caplog.text and "--overwrite" in caplog.text
    assert extract.main([c.manifest, "train", 2, 0, feats]) == 2  # another shard count beside train_0_1
    assert "already holds split 'train' in other shards (train_0_1.npy)" in caplog.text
    (feats / f"{SHARD}.json").rename(tmp_path / "note.json")  # a dump from another tool
    assert extract.main([c.manifest, "train", 1, 0, feats, *COMMIT]) == 2 and "exists without its" in caplog.text
    (tmp_path / "note.json").rename(feats / f"{SHARD}.json")
    caplog.clear()  # decoding into the feature folder would replace the features with their reconstruction
    assert encode.main(["decode", "--checkpoint", c.fbank_run, "--codes_dir", c.root / "fbank_encoded",
                        "--output_dir", feats]) == 2
    assert "train_0_1.npy exists: decoding into" in caplog.text and "--overwrite" in caplog.text
    assert files_of(feats, SHARD, EXTRACTED) == before and not list(feats.glob("*.tmp"))
    assert extract.main([one, "train", 1, 0, feats, "--overwrite"]) == 0  # asked for: starts over
    assert json.loads((feats / f"{SHARD}.json").read_text())["utterances"] == 1


@pytest.mark.parametrize("under", [False, True], ids=["a_file", "under_a_file"])
@pytest.mark.parametrize("tool", ["extract", "tokenize", "encode", "decode", "export", "report"])
def test_an_output_folder_that_is_a_file_exits_2_in_one_line_and_writes_nothing(corpus, tmp_path, caplog, tool,
                                                                                 under):
    c, file = corpus, tmp_path / "F"
    file.write_text("not a folder\n")
    out = file / "sub" if under else file
    main, argv = {
        "extract": (extract.main, [c.manifest, "train", 1, 0, out]),
        "tokenize": (tokenize.main, [c.manifest, "train", 1, 0, out, "--checkpoint", c.fbank_run]),
        "encode": (encode.main, ["--checkpoint", c.fbank_run, "--data_dir", c.fbank_feats, "--output_dir", out]),
        "decode": (encode.main, ["decode", "--checkpoint", c.fbank_run, "--codes_dir", c.root / "fbank_encoded",
                                 "--output_dir", out]),
        "export": (export.main, [c.fbank_run, out]),
        "report": (report.main, [c.fbank_run, "--out", out]),
    }[tool]
    before = tree(tmp_path)
    assert main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(out) in errors[0], errors
    assert ("cannot be made or written (Not a directory)" if under else "is a file, not a folder") in errors[0]
    assert tree(tmp_path) == before


def test_a_code_folder_holds_a_split_in_one_count_of_shards(corpus, tmp_path, caplog):
    """encode and tokenize refuse a shard beside the split's shards of another count, finished or begun, as extract
    refuses a dump's: a glob over the folder's .codes.parquet would read the split's utterances twice."""
    c, out, begun = corpus, tmp_path / "codes", tmp_path / "begun"
    encoded = ["--checkpoint", c.fbank_run, "--data_dir", c.fbank_feats, "--beam_size", 1]
    assert encode.main([*encoded, "--output_dir", out]) == 0
    before = tree(out)
    for main, argv in ((encode.main, [*encoded, "--output_dir", out, "--nshard", 2, "--rank", 0]),
                       (tokenize.main, [c.manifest, "train", 2, 1, out, "--checkpoint", c.fbank_run])):
        caplog.clear()
        assert main(argv) == 2
        assert f"{out} already holds split 'train' in other shards (train_0_1.codes.npy)" in caplog.text
    assert tree(out) == before
    begun.mkdir()
    (begun / "train_1_2.codes.progress").write_text("{}\n")  # a shard of 2 begun there
    caplog.clear()
    assert encode.main([*encoded, "--output_dir", begun]) == 2
    assert "in other shards (train_1_2.codes.progress)" in caplog.text and not (begun / "train_0_1.codes.npy").exists()


def test_publish_renames_over_and_never_deletes_first(tmp_path, monkeypatch):
    final, tmp, len_final, len_tmp = (tmp_path / n for n in ("a.npy", "a.npy.tmp", "a.len", "a.len.tmp"))
    for path, text in ((final, "old"), (tmp, "new"), (len_final, "1"), (len_tmp, "2")):
        path.write_text(text)
    monkeypatch.setattr(os, "unlink", lambda *a, **k: pytest.fail("publish deleted a file"))
    monkeypatch.setattr(Path, "unlink", lambda *a, **k: pytest.fail("publish deleted a file"))
    publish([(len_tmp, len_final)], (tmp, final))
    assert final.read_text() == "new" and len_final.read_text() == "2" and not tmp.exists()


def test_the_encode_bar_moves_before_the_first_commit(corpus, tmp_path, monkeypatch):
    events = []
    real_update, real_commit = encode.tqdm.update, ShardWriter.commit
    monkeypatch.setattr(encode.tqdm, "update", lambda self, n=1: (events.append("batch"), real_update(self, n))[1])
    monkeypatch.setattr(ShardWriter, "commit",
                        lambda self, done: (events.append("commit"), real_commit(self, done))[1])
    assert encode.main(["--checkpoint", corpus.fbank_run, "--data_dir", corpus.fbank_feats, "--output_dir", tmp_path,
                        "--batch_frames", 64]) == 0  # one commit, several batches
    assert events.index("commit") >= 3 and events[:3] == ["batch"] * 3, events


def test_under_torchrun_each_process_takes_its_part_of_the_shard(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert extract.main([corpus.manifest, "train", 1, 0, tmp_path]) == 0  # process 1 of 2: shard 1 of 2
    lines = (tmp_path / "train_1_2.tsv").read_text().splitlines()[1:]
    assert [line.split("\t")[0] for line in lines] == [rel for rel in corpus.files[4:]]  # round(7 / 2) = 4


def begun_before_pass_rules(progress: Path, **recorded) -> None:
    """A shard's progress file as a run before pass rules were recorded left it: its settings name no pass rule."""
    record = json.loads(progress.read_text())
    del record["settings"]["passes"]
    record["settings"].update(recorded)
    progress.write_text(json.dumps(record) + "\n")


def test_a_w2v_shard_begun_before_pass_rules_goes_on_with_its_own_and_resumes_to_the_bytes(corpus, tmp_path,
                                                                                          caplog, monkeypatch):
    """A shard begun with passes filled in length order and transformers' attention, its windows of 30 s (a default
    since changed): it finishes, and resumes after a kill, with those, to the same bytes; found complete after."""
    c, out, killed = corpus, tmp_path / "feats", tmp_path / "killed"
    args = [c.manifest, "train", 1, 0, out, *COMMIT, *W2V, "--checkpoint", c.w2v, "--num_workers", 1]
    run = subprocess.run([sys.executable, "-m", "tools.extract", *map(str, args)], capture_output=True, text=True,
                         timeout=120, cwd=REPO,
                         env=env(RVQ_FAULT="kill:step=1", OMP_NUM_THREADS=torch.get_num_threads()))
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]  # begun, nothing committed
    begun_before_pass_rules(out / f"{SHARD}.progress", commit_seconds=30.0)
    shutil.copytree(out, killed)
    kill_args = [killed if a == out else a for a in args]
    attention, filled = [], []
    layer = extract.W2vBertLayer
    monkeypatch.setattr(extract, "W2vBertLayer", lambda *a, **k: attention.append(k["attention"]) or layer(*a, **k))
    fill = pass_plan.length_sorted_batches
    monkeypatch.setattr(pass_plan, "length_sorted_batches", lambda *a, **k: filled.append(1) or fill(*a, **k))
    assert extract.main(args) == 0
    assert attention == ["stock"] and filled, (attention, len(filled))
    assert "begun before pass rules were recorded" in caplog.text
    settings = json.loads((out / f"{SHARD}.json").read_text())
    assert "passes" not in settings and settings["commit_seconds"] == 30.0
    killed_after_first_commit("tools.extract", kill_args, killed, f"{SHARD}.progress")
    assert extract.main(kill_args) == 0
    assert files_of(killed, SHARD, EXTRACTED) == files_of(out, SHARD, EXTRACTED)
    caplog.clear()
    assert extract.main(args) == 0 and f"{SHARD} is complete" in caplog.text
    caplog.clear()  # a flag that names other passes: refused, as any other setting
    assert extract.main([*args, "--batch_seconds", 5]) == 2 and "batch_seconds: 2.5 -> 5.0" in caplog.text
    assert files_of(killed, SHARD, EXTRACTED) == files_of(out, SHARD, EXTRACTED)


def test_a_finished_w2v_code_shard_from_before_pass_rules_is_complete(corpus, tmp_path, caplog):
    c, out = corpus, tmp_path / "codes"
    shutil.copytree(c.root / "w2v_tokenized", out)
    meta = out / f"{SHARD}.codes.json"
    record = json.loads(meta.read_text())
    settings = record.get("settings", record)
    del settings["passes"]
    meta.write_text(json.dumps(record) + "\n")
    before = files_of(out, SHARD, CODES)
    args = [c.manifest, "train", 1, 0, out, "--checkpoint", c.w2v_run, *COMMIT, "--batch_seconds", 2.5, "--km"]
    assert tokenize.main(args) == 0 and f"{SHARD} is complete" in caplog.text
    assert files_of(out, SHARD, CODES) == before


def test_a_w2v_shard_goes_on_under_the_compile_it_was_begun_with(corpus, tmp_path, caplog):
    """torch.compile changes a layer's last bits, so a w2v-bert shard records it and keeps it: a shard begun
    compiled is compiled again without the flag, and a --compile naming the other is refused, either way."""
    c = corpus
    args = [c.manifest, "train", 1, 0, None, *COMMIT, *W2V, "--checkpoint", c.w2v]
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    shutil.copytree(c.w2v_feats, compiled)
    shutil.copytree(c.w2v_feats, eager)
    meta = compiled / f"{SHARD}.json"
    record = json.loads(meta.read_text())
    assert "compile" not in record.get("settings", record)  # --compile off, the default: nothing noted
    record.get("settings", record)["compile"] = "on"
    meta.write_text(json.dumps(record) + "\n")

    args[4] = compiled
    assert extract.main(args) == 0 and f"{SHARD} is complete" in caplog.text
    assert "under torch.compile" in caplog.text
    caplog.clear()
    assert extract.main([*args, "--compile", "off"]) == 2
    assert "the shard was begun with --compile on" in caplog.text
    args[4] = eager
    caplog.clear()
    assert extract.main([*args, "--compile", "on"]) == 2 and "compile" in caplog.text
    assert extract.main([*args, "--compile", "off"]) == 0


def test_graph_mode_needs_a_gpu_and_a_shard_goes_on_in_the_mode_it_was_begun_in(corpus, tmp_path, caplog):
    """--graphs on pads each chunk to its graph's shape, other last bits: refused on a CPU before anything is written,
    and, like --compile, kept by a shard (a flag naming the other mode is refused)."""
    c = corpus
    args = [c.manifest, "train", 1, 0, tmp_path / "new", *COMMIT, *W2V, "--checkpoint", c.w2v]
    assert extract.main([*args, "--graphs", "on"]) == 2
    assert "--graphs on records a pass as a CUDA graph: it needs a GPU" in caplog.text
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").iterdir())
    with pytest.raises(SystemExit) as stop:
        extract.main([*args, "--graphs", "on", "--compile", "on"])
    assert stop.value.code == 2
    graphed, eager = tmp_path / "graphed", tmp_path / "eager"
    shutil.copytree(c.w2v_feats, graphed)
    shutil.copytree(c.w2v_feats, eager)
    record = json.loads((graphed / f"{SHARD}.json").read_text())
    assert "graphs" not in record.get("settings", record)  # off, the default: nothing noted
    record.get("settings", record)["graphs"] = "on"
    (graphed / f"{SHARD}.json").write_text(json.dumps(record) + "\n")
    for out, flag, begun in ((graphed, "off", "on"), (eager, "on", "off")):
        caplog.clear()
        assert extract.main([*args[:4], out, *args[5:], "--graphs", flag]) == 2
        assert f"the shard was begun with --graphs {begun}" in caplog.text
    before_rules = tmp_path / "before_rules"  # a shard begun before pass rules: transformers' attention, no graph
    shutil.copytree(c.w2v_feats, before_rules)
    record = json.loads((before_rules / f"{SHARD}.json").read_text())
    del record.get("settings", record)["passes"]
    (before_rules / f"{SHARD}.json").write_text(json.dumps(record) + "\n")
    caplog.clear()
    assert extract.main([*args[:4], before_rules, *args[5:], "--graphs", "on"]) == 2
    assert "the shard was begun before pass rules were recorded" in caplog.text and "--graphs on" in caplog.text


def recorded_attention(folder: Path, meta: str, kernel: str | None) -> None:
    """A finished shard's settings as if it had been begun with attention `kernel` (None: before kernels were
    recorded)."""
    path = folder / meta
    record = json.loads(path.read_text())
    settings = record.get("settings", record)
    settings.pop("attention")
    if kernel is not None:
        settings["attention"] = kernel
    path.write_text(json.dumps(record) + "\n")


def test_a_w2v_shard_goes_on_with_the_attention_kernel_it_was_begun_with(corpus, tmp_path, caplog, monkeypatch):
    """Kernels differ in their last bits, so a w2v-bert shard records its kernel: a resume takes it, a flag naming
    another is refused, and a kernel that cannot run here exits 2 naming it; a shard begun before kernels were
    recorded goes on with its own (auto). Tokenize records its kernel too."""
    c = corpus
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert json.loads((c.w2v_feats / f"{SHARD}.json").read_text())["attention"] == "fold"  # a CPU's
    assert json.loads((c.root / "w2v_tokenized" / f"{SHARD}.codes.json").read_text())["attention"] == "fold"
    args = [c.manifest, "train", 1, 0, None, *COMMIT, *W2V, "--checkpoint", c.w2v]
    for kernel in ("gather", "triton", None):
        out = args[4] = tmp_path / str(kernel)
        shutil.copytree(c.w2v_feats, out)
        recorded_attention(out, f"{SHARD}.json", kernel)
        caplog.clear()
        if kernel == "gather":
            assert extract.main(args) == 0 and f"{SHARD} is complete" in caplog.text
            assert "w2v-bert attention: gather (the shard's own)" in caplog.text
            assert extract.main([*args, "--attention", "fold"]) == 2
            assert "the shard was begun with --attention gather, whose last bits differ" in caplog.text
            assert extract.main([*args, "--attention", "gather"]) == 0
        elif kernel == "triton":
            assert extract.main(args) == 2
            assert "the shard was begun with the attention kernel triton, which cannot run here (Triton runs on " \
                   "CUDA" in caplog.text and "--overwrite to start it over" in caplog.text
        else:
            assert extract.main(args) == 0 and f"{SHARD} is complete" in caplog.text
            assert "attention" not in json.loads((out / f"{SHARD}.json").read_text())
            assert extract.main([*args, "--attention", "gather"]) == 2
            assert "begun before attention kernels were recorded" in caplog.text
    caplog.clear()  # a new shard: the kernel asked for, or a clear refusal of one that cannot run here
    assert extract.main([*args[:4], tmp_path / "new", *args[5:], "--attention", "triton"]) == 2
    assert "--attention triton cannot run here" in caplog.text and not (tmp_path / "new").exists()


BEGUN_BEFORE = REPO / "tests" / "data" / "shards_cf27e23"  # its README says how they were made


def resumable_copy(begun: Path, out: Path, root: Path) -> None:
    """A begun shard of BEGUN_BEFORE in `out`, its folder `@ROOT@` made `root`: in its settings, and in the root
    line its manifest stream opens with (whose committed size changes with it)."""
    shutil.copytree(begun, out)
    grown = len(str(root)) - len("@ROOT@")
    for progress in out.glob("*.progress"):
        record = json.loads(progress.read_text().replace("@ROOT@", str(root)))
        for ext in record["sizes"]:
            if ext.endswith(".tsv"):
                record["sizes"][ext] += grown
        progress.write_text(json.dumps(record) + "\n")
    for tsv in out.glob("*.tsv.partial"):
        tsv.write_text(tsv.read_text().replace("@ROOT@", str(root)))


def test_shards_begun_before_the_shard_module_resume_to_the_bytes_of_an_unbroken_run(tmp_path, caplog):
    """A feature dump and a code shard that tools of cf27e23 began and were killed in: today's tools resume them
    from their commit, dropping what was written after it, and finish them as an unbroken run of today's tools
    does: the same text files, and the same rows after the committed ones (those, computed on the machine that
    made the fixture, within float rounding of this one's)."""
    audio = tmp_path / "audio"
    write_corpus(audio, CORPUS[:6])
    assert extract.main([audio, "train", 1, 0, tmp_path / "feats", *COMMIT]) == 0  # unbroken, today's
    codec = random_codec(tmp_path / "codec.pt", tmp_path / "feats", feature_dim=160)
    tokenize_args = ["--checkpoint", codec, *COMMIT, "--km", 1]
    assert tokenize.main([audio, "train", 1, 0, tmp_path / "codes", *tokenize_args]) == 0
    for kind, tool, extra, array, texts in (
            ("feats", extract, [], ".npy", (".len", ".tsv", ".skipped", ".json")),
            ("codes", tokenize, tokenize_args, ".codes.npy", (".codes.len", ".codes.tsv", ".codes.skipped", ".km"))):
        begun = tmp_path / f"begun_{kind}"
        resumable_copy(BEGUN_BEFORE / kind, begun, tmp_path)
        committed = json.loads(next(begun.glob("*.progress")).read_text())
        assert committed["done"] == 2 and committed["commits"] == 1
        if kind == "codes":
            assert committed["settings"]["codec_digest"] == json.loads(
                (tmp_path / "codes" / f"{SHARD}.codes.json").read_text())["codec_digest"]  # the same random codec
        caplog.clear()
        assert tool.main([audio, "train", 1, 0, begun, *extra]) == 0, caplog.text[-2000:]
        assert "resuming at file 2 of 6" in caplog.text and "after the last commit dropped" in caplog.text
        assert files_of(begun, SHARD, texts) == files_of(tmp_path / kind, SHARD, texts)
        resumed, unbroken = (np.load(folder / (SHARD + array)) for folder in (begun, tmp_path / kind))
        rows = committed["rows"]
        assert resumed.shape == unbroken.shape and 0 < rows < len(unbroken)
        assert np.array_equal(resumed[rows:], unbroken[rows:])
        assert np.allclose(resumed[:rows], unbroken[:rows], atol=1e-5)
