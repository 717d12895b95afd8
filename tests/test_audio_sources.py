"""Corpora as they are shipped: WebDataset tar shards, Hugging Face parquet (and save_to_disk), Lhotse cuts, each
written here with its own library, read straight into tools.extract and tools.tokenize: the features of loose
files, each utterance in one shard under its key, the unreadable skipped and listed, a kill resumed to the bytes."""
import io
import json
import logging
import signal
import tarfile
from pathlib import Path
from types import SimpleNamespace

import datasets  # requirements-sources.txt, which requirements-dev.txt installs: a missing one fails, never skips
import lhotse
import numpy as np
import pyarrow as pa
import pytest
import soundfile as sf
import webdataset as wds

from data.audio.features import SeamlessFbank, model_input
from data.audio.sources import source_kind
from tests.audio_helpers import random_codec, write_corpus
from tests.helpers import env, run_python
from tools import encode, extract, tokenize

pytestmark = pytest.mark.timeout(180)


DUMP = (".npy", ".len", ".tsv", ".skipped", ".json")


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


def key_of(rel: str) -> str:
    """A loose file's WebDataset key: its path up to the first dot of its name."""
    return rel.split(".", 1)[0]


def features_by_key(folder: Path, split: str = "train") -> dict:
    """{key: features} of every shard of the split, checking each key appears once."""
    found = {}
    for tsv in sorted(folder.glob(f"{split}_*_*.tsv")):
        array = np.load(tsv.with_suffix(".npy"))
        lengths = [int(n) for n in tsv.with_suffix(".len").read_text().split()]
        keys = [line.split("\t")[0] for line in tsv.read_text().split("\n")[1:] if line]
        assert len(keys) == len(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for k, key in enumerate(keys):
            assert key not in found, f"{key} in two shards"
            found[key] = array[offsets[k]:offsets[k + 1]]
    return found


def skipped(folder: Path) -> dict:
    return dict(line.split("\t", 1) for p in sorted(folder.glob("*.skipped")) for line in p.read_text().splitlines())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus as loose files and their fbank dump; the same audio as tar shards, parquet, a save_to_disk folder
    and a CutSet, each with a member, row or cut that cannot be read."""
    root = tmp_path_factory.mktemp("sources")
    c = SimpleNamespace(root=root, audio=root / "audio")
    c.rels = write_corpus(c.audio)
    c.loose = root / "loose"
    assert extract.main([c.audio, "train", 1, 0, c.loose, "--num_workers", 0]) == 0
    c.expected = features_by_key(c.loose)  # keyed by relpath
    payload = {rel: (c.audio / rel).read_bytes() for rel in c.rels}

    c.tars = root / "tars"
    c.tars.mkdir()
    for t, group in enumerate((c.rels[:4], c.rels[4:7], c.rels[7:])):
        with wds.TarWriter(str(c.tars / f"train-{t:03d}.tar")) as sink:
            for rel in group:
                sink.write({"__key__": key_of(rel), Path(rel).suffix[1:]: payload[rel],
                            "json": json.dumps({"text": rel}).encode()})
            if t == 1:
                sink.write({"__key__": "broken", "flac": b"these bytes are not flac" * 20})
                sink.write({"__key__": "text_only", "txt": b"no audio here"})
    c.pattern = str(c.tars / "train-{000..002}.tar")

    table = pa.table({"id": [f"row{k}" for k in range(len(c.rels) + 1)],
                      "audio": [{"bytes": payload[rel], "path": Path(rel).name} for rel in c.rels]
                      + [{"bytes": b"not audio at all" * 10, "path": "bad.wav"}]})
    c.row_of = {f"row{k}": rel for k, rel in enumerate(c.rels)}
    ds = datasets.Dataset(table).cast_column("audio", datasets.Audio(decode=False))
    c.parquet = root / "parquet"
    c.parquet.mkdir()
    ds.to_parquet(str(c.parquet / "train-00000-of-00001.parquet"), batch_size=3)  # row groups of 3
    c.saved = root / "saved"
    ds.save_to_disk(str(c.saved), num_shards=2)

    recordings = [lhotse.Recording.from_file(str(c.audio / rel), recording_id=key_of(rel).replace("/", "_"))
                  for rel in c.rels]
    cuts = [r.to_cut() for r in recordings]
    c.span = recordings[3].to_cut().truncate(offset=0.5, duration=1.0)
    beyond = recordings[4].to_cut().truncate(offset=0.2, duration=0.5).to_dict()
    beyond["duration"] = 30.0  # past its 1-s recording's end
    c.cuts = root / "cuts.jsonl.gz"
    lhotse.CutSet.from_cuts([*cuts, c.span, lhotse.serialization.deserialize_item(beyond)]).to_file(str(c.cuts))
    c.cut_rel = {cut.id: rel for cut, rel in zip(cuts, c.rels, strict=True)}
    c.beyond = beyond["id"]
    return c


def test_tar_shards_give_the_features_of_loose_files_each_in_one_shard_under_its_key(corpus, tmp_path):
    c, out = corpus, tmp_path / "feats"
    for rank in (0, 1):  # 3 tars in 2 shards: tars 0-1 and tar 2; rank 0 with worker processes
        assert extract.main([c.pattern, "train", 2, rank, out, "--num_workers", 2 - 2 * rank]) == 0
    got = features_by_key(out)
    assert set(got) == {key_of(rel) for rel in c.rels}
    for rel in c.rels:
        np.testing.assert_array_equal(got[key_of(rel)], c.expected[rel])
    lines = (out / "train_0_2.tsv").read_text().split("\n")
    assert lines[0] == str(Path(c.pattern).absolute())
    reasons = skipped(out)
    assert set(reasons) == {"broken", "text_only"}
    assert reasons["broken"].startswith("unreadable") and "no audio member (.flac" in reasons["text_only"]
    meta = json.loads((out / "train_0_2.json").read_text())
    assert meta["source_kind"] == "webdataset" and meta["first_file"] == 0  # tars 0-1 of 3
    codes = tmp_path / "codes"  # tools.encode carries the keys into its .codes.tsv
    assert encode.main(["--checkpoint", random_codec(tmp_path / "codec.pt", out, 160), "--data_dir", out,
                        "--output_dir", codes]) == 0
    keys = [line.split("\t")[0] for line in (codes / "train_0_1.codes.tsv").read_text().split("\n")[1:] if line]
    assert keys == [line.split("\t")[0] for shard in ("train_0_2", "train_1_2")
                    for line in (out / f"{shard}.tsv").read_text().split("\n")[1:] if line]


def test_parquet_and_a_saved_dataset_give_the_features_of_loose_files(corpus, tmp_path, caplog):
    c = corpus
    for source, nshard in ((c.parquet, 2), (c.saved, 1)):
        out = tmp_path / source.name
        for rank in range(nshard):  # one parquet file of 4 row groups in 2 shards: split by rows
            assert extract.main([source, "train", nshard, rank, out, "--num_workers", rank]) == 0
        got = features_by_key(out)
        assert set(got) == set(c.row_of)
        for key, rel in c.row_of.items():
            np.testing.assert_array_equal(got[key], c.expected[rel])
        reasons = skipped(out)
        assert list(reasons) == [f"row{len(c.rels)}"] and reasons[f"row{len(c.rels)}"].startswith("unreadable")
    out = tmp_path / "keyed"  # a key column the table does not have: exit 2 naming its columns, nothing written
    assert extract.main([c.parquet, "train", 1, 0, out, "--key_column", "utt", "--num_workers", 0]) == 2
    assert "has no column 'utt' (its columns: id, audio)" in caplog.text and not out.exists()


def test_lhotse_cuts_are_read_as_their_span_of_the_recording(corpus, tmp_path):
    c, out = corpus, tmp_path / "feats"
    for rank in (0, 1):
        assert extract.main([c.cuts, "train", 2, rank, out, "--num_workers", rank]) == 0
    got = features_by_key(out)
    assert set(got) == set(c.cut_rel) | {c.span.id}
    for cut_id, rel in c.cut_rel.items():
        np.testing.assert_array_equal(got[cut_id], c.expected[rel])
    data, rate = sf.read(str(c.audio / c.rels[3]), dtype="float32", always_2d=True)
    span = data[int(0.5 * rate):int(0.5 * rate) + int(round(1.0 * rate))]
    np.testing.assert_allclose(got[c.span.id], SeamlessFbank()(model_input(span, rate)), atol=1e-6)
    reasons = skipped(out)
    assert list(reasons) == [c.beyond] and "more audio" in reasons[c.beyond].lower()


def test_a_truncated_tar_is_read_up_to_the_cut_and_the_rest_listed(corpus, tmp_path):
    c = corpus
    whole = (c.tars / "train-000.tar").read_bytes()
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(whole)).getmembers()}
    cut_inside = members[c.rels[2]]  # the third sample's audio: its first 100 bytes kept
    (tmp_path / "cut.tar").write_bytes(whole[:cut_inside.offset_data + 100])
    out = tmp_path / "feats"
    assert extract.main([tmp_path / "cut.tar", "train", 1, 0, out, "--num_workers", 0]) == 0
    got = features_by_key(out)
    assert set(got) == {key_of(rel) for rel in c.rels[:2]}
    reasons = skipped(out)
    assert reasons[key_of(c.rels[2])].startswith(f"truncated: the tar ends inside {cut_inside.name}")
    assert "cut.tar" in reasons and "lost" in reasons["cut.tar"]


def test_a_corrupt_parquet_file_is_skipped_and_listed_and_the_others_read(corpus, tmp_path):
    """A parquet file cut short (a failed download: its footer gone) beside a whole one: the run goes on, its
    rows listed as lost under its name, as a truncated tar is."""
    c, source = corpus, tmp_path / "parquet"
    source.mkdir()
    whole = (c.parquet / "train-00000-of-00001.parquet").read_bytes()
    (source / "train-00000-of-00002.parquet").write_bytes(whole)
    (source / "train-00001-of-00002.parquet").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "feats"
    assert extract.main([source, "train", 1, 0, out, "--num_workers", 0]) == 0
    assert set(features_by_key(out)) == set(c.row_of)
    reasons = skipped(out)
    assert reasons["train-00001-of-00002.parquet"].startswith("not a readable parquet file")
    assert set(reasons) == {"train-00001-of-00002.parquet", f"row{len(c.rels)}"}


@pytest.mark.parametrize("name", ["corpus.zip", "shards.tar.gz"])
def test_a_source_of_no_known_kind_exits_2_naming_what_is_accepted(tmp_path, caplog, name):
    (tmp_path / name).write_bytes(b"PK\x03\x04 not a corpus")
    out = tmp_path / "out"
    assert extract.main([tmp_path / name, "train", 1, 0, out]) == 2
    assert "WebDataset" in caplog.text or "plain .tar" in caplog.text
    assert not out.exists() or not any(out.iterdir())


def test_a_brace_pattern_naming_a_tar_not_there_exits_2_naming_it_and_a_glob_takes_what_there_is(corpus, tmp_path,
                                                                                                 caplog):
    c, out = corpus, tmp_path / "feats"
    assert extract.main([str(c.tars / "train-{000..004}.tar"), "train", 1, 0, out]) == 2  # tars 000-002 are there
    assert "2 of the 5 files it names are not there" in caplog.text
    assert "train-003.tar" in caplog.text and "train-004.tar" in caplog.text and "fetch the missing" in caplog.text
    assert not out.exists()
    assert source_kind(Path(c.tars / "train-00*.tar")) == ("webdataset", sorted(c.tars.glob("*.tar")))


def test_a_source_whose_name_holds_brackets_or_braces_is_taken_as_named(corpus, tmp_path):
    c = corpus
    codec = random_codec(tmp_path / "codec.pt", c.loose, 160)
    for k, name in enumerate(("My Recordings [2024]", "takes {a,b}")):
        folder = tmp_path / name
        folder.mkdir()
        for rel in c.rels[:2]:
            (folder / rel).write_bytes((c.audio / rel).read_bytes())
        (folder / "train.tsv").write_text(f"{folder}\n" + "".join(f"{rel}\t1\n" for rel in c.rels[:2]))
        for source in (folder, folder / "train.tsv"):
            out = tmp_path / f"feats{k}_{source.suffix}"
            assert extract.main([source, "train", 1, 0, out, "--num_workers", 0]) == 0, source
            assert (out / "train_0_1.tsv").read_text().split("\n")[0] == str(folder.resolve())
            got = features_by_key(out)
            assert list(got) == c.rels[:2]
            for rel in c.rels[:2]:
                np.testing.assert_array_equal(got[rel], c.expected[rel])
    out = tmp_path / "codes"
    assert tokenize.main([folder, "train", 1, 0, out, "--checkpoint", codec, "--num_workers", 0]) == 0
    assert (out / "train_0_1.codes.tsv").read_text().split("\n")[0] == str(folder.resolve())


def run_killed(module: str, args: list) -> None:
    killed = run_python(["-m", module, *args], timeout=120, env=env(RVQ_FAULT="kill:step=2"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["tools.extract", "tools.tokenize"])
def test_a_killed_tar_run_resumes_to_the_bytes_of_one_never_stopped(corpus, tmp_path, caplog, module):
    c = corpus
    tool = extract if module == "tools.extract" else tokenize
    codec = [] if tool is extract else ["--checkpoint", random_codec(tmp_path / "codec.pt", c.loose, 160)]
    exts = DUMP if tool is extract else (".codes.npy", ".codes.len", ".codes.tsv", ".codes.skipped", ".codes.json")
    args = lambda out: [c.pattern, "train", 1, 0, out, "--commit_files", 2, "--num_workers", 1, *codec]  # noqa: E731
    assert tool.main(args(tmp_path / "unbroken")) == 0
    run_killed(module, args(tmp_path / "killed"))
    assert tool.main(args(tmp_path / "killed")) == 0
    assert "resuming at utterance 2 of" in caplog.text
    if tool is tokenize:  # each row named by its tar key
        lines = (tmp_path / "killed" / "train_0_1.codes.tsv").read_text().split("\n")
        assert {line.split("\t")[0] for line in lines[1:] if line} == {key_of(rel) for rel in c.rels}
    for ext in exts:
        assert (tmp_path / "killed" / f"train_0_1{ext}").read_bytes() == \
            (tmp_path / "unbroken" / f"train_0_1{ext}").read_bytes(), ext


def test_a_folder_of_tars_and_a_plain_cutset_are_read_and_audio_ext_picks_the_member(corpus, tmp_path):
    c = corpus
    folder = tmp_path / "shards"  # a folder holding tars: WebDataset shards; each sample has two audio members
    folder.mkdir()
    with wds.TarWriter(str(folder / "part.tar")) as sink:
        sink.write({"__key__": "both", "wav": (c.audio / c.rels[0]).read_bytes(),
                    "flac": (c.audio / c.rels[1]).read_bytes()})
    for ext, rel in (("wav", c.rels[0]), ("flac", c.rels[1])):
        out = tmp_path / ext
        assert extract.main([folder, "train", 1, 0, out, "--audio_ext", ext, "--num_workers", 0]) == 0
        np.testing.assert_array_equal(features_by_key(out)["both"], c.expected[rel])
    plain = tmp_path / "cuts.jsonl"  # the CutSet uncompressed
    lhotse.CutSet.from_file(str(c.cuts)).subset(first=2).to_file(str(plain))
    out = tmp_path / "cuts"
    assert extract.main([plain, "train", 1, 0, out, "--num_workers", 0]) == 0
    got = features_by_key(out)
    assert [c.cut_rel[k] for k in got] == c.rels[:2]
    for key, features in got.items():
        np.testing.assert_array_equal(features, c.expected[c.cut_rel[key]])
