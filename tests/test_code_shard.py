"""rvq_tokenizer/code_shard.py's CodeShard in this process: the files of a shard of codes, streamed (tools.tokenize's
way) or of known utterances (tools.encode's), resumed from a commit to the bytes of an unbroken shard, a finished one
left alone with its parquet completed, and one whose every file was skipped discarded."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from data.shard_layout import CODES, PARTIAL
from models.codec import CodecConfig, RVQCodec
from models.codes import code_frames, km_lines
from rvq_tokenizer.code_shard import CodeShard
from rvq_tokenizer.codes_spec import CodesRequest, codes_spec

pytestmark = pytest.mark.timeout(60)
NAME = "train_0_1"
FRAMES = [7, 12, 3, 9, 16]  # feature frames of five utterances
KEYS = [f"u{i}.wav\t{320 * n}" for i, n in enumerate(FRAMES)]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """The codes of a small codec: 2 levels of 16 codes, downsample 2, level 1 also as .km."""
    config = CodecConfig(feature_dim=8, latent_dim=8, num_quantizers=2, codebook_size=16, downsample=2,
                         kmeans_init=False)
    path = tmp_path_factory.mktemp("codec") / "step_00000001.pt"
    return codes_spec(CodesRequest(None, None, None, 1, False), RVQCodec(config), {"model": {}, "step": 1}, path,
                      torch.device("cpu"))


def codes_of(i: int) -> np.ndarray:
    """Utterance i's codes: its code frames x 2 levels."""
    n = int(code_frames(np.array([FRAMES[i]]), 2)[0])
    return (np.arange(2 * n, dtype=np.int16).reshape(n, 2) + i) % 16


def settings(**more) -> dict:
    return {"split": "train", "nshard": 1, "rank": 0, "codec_digest": "sha256:0", "checkpoint": "c.pt", "step": 1,
            **more}


def begin(folder: Path, spec, streamed: bool, **kwargs) -> CodeShard | None:
    return CodeShard.begin(folder, NAME, spec, settings(), overwrite=False, redo="do it again",
                           root="/audio" if streamed else None, **kwargs)


def write(shard: CodeShard, first: int, end: int, streamed: bool) -> None:
    codes = np.concatenate([codes_of(i) for i in range(first, end)])
    frames = np.array(FRAMES[first:end])
    assert shard.write(codes, frames, KEYS[first:end] if streamed else ()).tolist() == \
        code_frames(frames, 2).tolist()


def meta(frames: list[int], skipped: int) -> dict:
    return {**settings(), "feature_frames": frames, "skipped": skipped}


def finish(shard: CodeShard, streamed: bool):
    if streamed:
        return shard.finish(meta, files="all 5 file(s)")
    return shard.finish(meta, feature_frames=np.array(FRAMES), keys=iter(["/audio\n", *(k + "\n" for k in KEYS)]))


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "known utterances"])
def test_a_code_shard_holds_each_utterance_s_codes_lines_and_record(tmp_path, spec, streamed):
    with begin(tmp_path, spec, streamed, inputs=5) as shard:
        write(shard, 0, 2, streamed)
        shard.commit(2)
        write(shard, 2, 5, streamed)
        shard.skip("9\tNaN or Inf features, codes -1: u9\n")
        shard.commit(5)
        array, frames, skipped = finish(shard, streamed)
        assert shard.wrote(5, array) == (f"wrote 5 utterances, {shard.rows} code frames (2 levels, 4 bits/frame of "
                                         f"features) to {array}")
    lengths = code_frames(np.array(FRAMES), 2)
    assert (frames, skipped) == (FRAMES, 1)
    assert np.array_equal(np.load(array), np.concatenate([codes_of(i) for i in range(5)]))
    assert (tmp_path / (NAME + CODES.lengths)).read_text() == "".join(f"{n}\n" for n in lengths)
    assert (tmp_path / (NAME + CODES.keys)).read_text() == "/audio\n" + "".join(k + "\n" for k in KEYS)
    assert (tmp_path / (NAME + CODES.km)).read_text() == km_lines(np.load(array), lengths, 1)
    assert (tmp_path / (NAME + CODES.skipped)).read_text() == "9\tNaN or Inf features, codes -1: u9\n"
    assert json.loads((tmp_path / (NAME + CODES.meta)).read_text()) == meta(FRAMES, 1)
    assert sorted(files(tmp_path)) == sorted(NAME + ext for ext in (
        CODES.array, CODES.meta, CODES.lengths, CODES.keys, CODES.skipped, CODES.km))  # no .codes.frames, no partial


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "known utterances"])
def test_a_resumed_code_shard_drops_what_came_after_its_commit_and_ends_as_an_unbroken_one(tmp_path, spec, streamed,
                                                                                           caplog):
    unbroken = tmp_path / "unbroken"
    with begin(unbroken, spec, streamed) as shard:
        write(shard, 0, 5, streamed)
        shard.commit(5)
        finish(shard, streamed)
    killed = tmp_path / "killed"
    shard = begin(killed, spec, streamed)
    write(shard, 0, 2, streamed)
    shard.commit(2)
    write(shard, 2, 4, streamed)  # written after the commit: a kill here
    shard.writer.close()
    caplog.set_level(logging.INFO)
    with begin(killed, spec, streamed) as shard:
        assert (shard.done, shard.rows) == (2, 4 + 6)
        shard.say_resumed("utterance", 5)
        write(shard, 2, 5, streamed)
        shard.commit(5)
        finish(shard, streamed)
    assert "resuming at utterance 2 of 5 (10 code frames committed;" in caplog.text
    assert files(killed) == files(unbroken)


def test_a_finished_code_shard_is_left_alone_and_its_parquet_written_when_asked(tmp_path, spec, caplog):
    pytest.importorskip("pyarrow", reason="the parquet view needs pip install -r requirements-sources.txt")
    with begin(tmp_path, spec, True) as shard:
        write(shard, 0, 5, True)
        shard.commit(5)
        finish(shard, True)
    before = files(tmp_path)
    caplog.set_level(logging.INFO)
    assert begin(tmp_path, spec, True, parquet=False) is None and f"{NAME} is complete" in caplog.text
    assert files(tmp_path) == before
    assert begin(tmp_path, spec, True, parquet=True) is None
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / (NAME + CODES.parquet))
    assert table.column("key").to_pylist() == [k.split("\t")[0] for k in KEYS]
    assert [len(c) for c in table.column("level_1").to_pylist()] == code_frames(np.array(FRAMES), 2).tolist()
    assert {k: v for k, v in files(tmp_path).items() if k in before} == before


def test_a_streamed_shard_whose_every_file_was_skipped_is_discarded(tmp_path, spec, caplog):
    with begin(tmp_path, spec, True) as shard:
        shard.skip("u0.wav\tempty\n")
        shard.commit(1)
        assert shard.finish(meta, files="all 1 file(s) of shard 0/1") is None
    assert "nothing written: all 1 file(s) of shard 0/1 were skipped" in caplog.text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((CODES.array, CODES.meta, PARTIAL))]
