"""Codes for language-model pipelines: tools.encode and tools.tokenize --parquet write NAME.codes.parquet, which
datasets.load_dataset("parquet") reads as it is: a row per utterance, its key and its codes at each level, equal to
the .codes.npy/.len/.tsv; written again by the same command when a run was killed while writing it; refused
before any work without pyarrow. An untrained codec of three audio files' fbank: seconds."""
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data import codes_parquet
from data.feature_settings import dump_feature_settings
from models.codec import CodecConfig, RVQCodec
from tests.audio_helpers import CORPUS, write_corpus
from tests.helpers import write_fairseq
from tools import encode, extract, tokenize

SHARD = "train_0_1"


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


def untrained_codec(path: Path, dim: int, features: dict | None = None) -> Path:
    """A checkpoint of an untrained codec (3 levels x 16 codes) recording `features` as the trainer does."""
    torch.manual_seed(0)
    config = CodecConfig(feature_dim=dim, latent_dim=16, num_quantizers=3, codebook_size=16, kmeans_init=False)
    torch.save({"model": RVQCodec(config).state_dict(), "codec": config.to_dict(), "step": 0,
                "config": {"features": features or {}}}, path)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Three audio files, their fbank dump (tools.extract: with .tsv) and a codec of it."""
    root = tmp_path_factory.mktemp("codes_parquet")
    s = SimpleNamespace(root=root, audio=root / "audio", feats=root / "feats")
    s.relpaths = write_corpus(s.audio, CORPUS[:3])
    assert extract.main([s.audio, "train", 1, 0, s.feats, "--feature", "fbank", "--num_workers", 0]) == 0
    s.codec = untrained_codec(root / "codec.pt", 160, dump_feature_settings(s.feats, "train"))
    return s


def loaded(path: Path, tmp_path: Path, monkeypatch) -> list[dict]:
    """The rows of a parquet file as datasets.load_dataset("parquet") gives them, offline."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    table = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    return list(table)


def shard_rows(folder: Path, name: str) -> list[dict]:
    """A row per utterance from the shard's own files: its key (the .codes.tsv's first field, else its index in
    the split) and its codes at each level."""
    codes = np.load(folder / f"{name}.codes.npy")
    lengths = [int(n) for n in (folder / f"{name}.codes.len").read_text().split()]
    tsv = folder / f"{name}.codes.tsv"
    first = json.loads((folder / f"{name}.codes.json").read_text()).get("first_utterance", 0)
    keys = ([line.split("\t")[0] for line in tsv.read_text().splitlines()[1:]] if tsv.is_file()
            else [str(first + i) for i in range(len(lengths))])
    ends = np.cumsum(lengths)
    return [{"key": key, **{f"level_{q + 1}": codes[end - n : end, q].tolist() for q in range(codes.shape[1])}}
            for key, n, end in zip(keys, lengths, ends)]


@pytest.mark.timeout(60)
def test_encode_parquet_is_read_by_datasets_as_it_is(small, tmp_path, monkeypatch):
    out = tmp_path / "codes"
    assert encode.main(["--checkpoint", small.codec, "--data_dir", small.feats, "--output_dir", out,
                        "--parquet"]) == 0
    rows = loaded(out / f"{SHARD}.codes.parquet", tmp_path, monkeypatch)
    assert rows == shard_rows(out, SHARD) and [r["key"] for r in rows] == small.relpaths
    assert list(rows[0]) == ["key", "level_1", "level_2", "level_3"]
    assert not list(out.glob("*.tmp"))
    import pyarrow.parquet as pq

    schema = pq.read_schema(out / f"{SHARD}.codes.parquet")
    assert str(schema.field("level_1").type) == "list<element: int16>"
    assert json.loads(schema.metadata[b"rvq_codes"])["root"] == str(small.audio.resolve())
    # a dump without a .tsv (not tools.extract's), rank 1 of 2: keys are the utterances' indices in the split
    dump = tmp_path / "dump"
    write_fairseq(dump, "train", [40, 7, 33, 25, 18], dim=16)
    codec = untrained_codec(tmp_path / "codec16.pt", 16)
    assert encode.main(["--checkpoint", codec, "--data_dir", dump, "--output_dir", tmp_path / "codes16",
                        "--nshard", 2, "--rank", 1, "--parquet"]) == 0
    rows = loaded(tmp_path / "codes16" / "train_1_2.codes.parquet", tmp_path, monkeypatch)
    assert [r["key"] for r in rows] == ["2", "3", "4"] and rows == shard_rows(tmp_path / "codes16", "train_1_2")


@pytest.mark.timeout(60)
def test_the_same_command_writes_the_parquet_a_killed_run_left_missing(small, tmp_path, monkeypatch, caplog):
    out = tmp_path / "codes"
    command = ["--checkpoint", small.codec, "--data_dir", small.feats, "--output_dir", out, "--parquet"]

    def killed(*args):
        raise KeyboardInterrupt  # stopped while the parquet is written, the shard finished

    with monkeypatch.context() as m:
        m.setattr(codes_parquet, "publish", killed)
        with pytest.raises(KeyboardInterrupt):
            encode.main(command)
    assert (out / f"{SHARD}.codes.npy").is_file() and not (out / f"{SHARD}.codes.parquet").exists()
    (out / f"{SHARD}.codes.parquet.tmp").write_bytes(b"PAR1 half a file")  # what a SIGKILL leaves
    caplog.clear()
    assert encode.main(command) == 0
    assert "is complete" in caplog.text and "codes.parquet is missing" in caplog.text
    said = [r.getMessage() for r in caplog.records]  # the last word comes once the parquet is there
    assert said.count("finished successfully") == 1 and said[-1] == "finished successfully", said
    assert loaded(out / f"{SHARD}.codes.parquet", tmp_path, monkeypatch) == shard_rows(out, SHARD)
    assert not list(out.glob("*.tmp"))
    caplog.clear()  # there now: left as it is
    written = (out / f"{SHARD}.codes.parquet").stat().st_mtime_ns
    assert encode.main(command) == 0 and "codes.parquet is missing" not in caplog.text
    assert (out / f"{SHARD}.codes.parquet").stat().st_mtime_ns == written


@pytest.mark.timeout(60)
def test_tokenize_parquet_keys_are_the_codes_tsvs(small, tmp_path, monkeypatch):
    out = tmp_path / "tokenized"
    assert tokenize.main([small.audio, "train", 1, 0, out, "--checkpoint", small.codec, "--num_workers", 0,
                          "--parquet"]) == 0
    rows = loaded(out / f"{SHARD}.codes.parquet", tmp_path, monkeypatch)
    tsv = (out / f"{SHARD}.codes.tsv").read_text().splitlines()[1:]
    assert [r["key"] for r in rows] == [line.split("\t")[0] for line in tsv] == small.relpaths
    assert rows == shard_rows(out, SHARD)


@pytest.mark.timeout(60)
def test_parquet_without_pyarrow_exits_2_naming_the_install_line(small, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as if not installed
    assert encode.main(["--checkpoint", small.codec, "--data_dir", small.feats, "--output_dir", tmp_path / "e",
                        "--parquet"]) == 2
    assert tokenize.main([small.audio, "train", 1, 0, tmp_path / "t", "--checkpoint", small.codec,
                          "--num_workers", 0, "--parquet"]) == 2
    assert caplog.text.count("pip install -r requirements-sources.txt") == 2
    assert list(tmp_path.iterdir()) == []
    listed = (Path(__file__).resolve().parent.parent / "requirements-sources.txt").read_text()
    assert "pyarrow>=" in listed
