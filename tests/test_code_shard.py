"""rvq_tokenizer/code_shard.py's CodeShard in this process: the files of a shard of codes, streamed (tools.tokenize's
way) or of known utterances (tools.encode's), resumed from a commit to the bytes of an unbroken shard, a finished one
left alone with its parquet completed, and one whose every file was skipped discarded."""
import dataclasses
import errno
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from data.shard_layout import CODES, PARTIAL
from models.codec import CodecConfig, RVQCodec
from errors import BadInputError, TransientFault
from models.codes import code_frames, km_lines
from rvq_tokenizer import code_shard
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
            "km_level": 1, **more}  # the spec's .km level


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


def km_shard(folder: Path, spec, level: int | None, *, streamed: bool = True, end: int = 5) -> CodeShard | None:
    """Shard NAME begun (or resumed, or found finished) with `level` as its .km level, its first `end` utterances
    written and committed, and finished when that is all of them."""
    spec = dataclasses.replace(spec, km=level)
    shard = CodeShard.begin(folder, NAME, spec, settings(km_level=level), overwrite=False, redo="do it again",
                            root="/audio" if streamed else None)
    if shard is None:
        return None
    with shard:
        write(shard, shard.done, end, streamed)
        shard.commit(end)
        if end == len(FRAMES):
            record = lambda frames, skipped: {**settings(km_level=level), "feature_frames": frames, "skipped": skipped}
            if streamed:
                shard.finish(record, files="all 5 file(s)")
            else:
                shard.finish(record, feature_frames=np.array(FRAMES),
                             keys=iter(["/audio\n", *(k + "\n" for k in KEYS)]))
    return shard


def written_with(folder: Path, spec, level: int | None, streamed: bool = True) -> dict[str, bytes]:
    """The files of shard NAME written with `level` as its .km level from the start."""
    km_shard(folder, spec, level, streamed=streamed)
    return files(folder)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "known utterances"])
def test_a_finished_shard_asked_for_another_km_level_has_it_written_from_its_codes(tmp_path, spec, streamed, caplog,
                                                                                   monkeypatch):
    """--km is a view of the codes: a finished shard asked for another level gets the files of a shard written with
    that level from the start (its .km, its record), its codes untouched and not computed again; asked for none, it
    keeps its .km; a .km gone missing is written again."""
    monkeypatch.setattr(code_shard, "KM_BLOCK_FRAMES", 5)  # utterances of 4, 6, 2, 5 and 8 code frames: 4 blocks
    folder = tmp_path / "shard"
    km_shard(folder, spec, None, streamed=streamed)
    codes = files(folder)[NAME + CODES.array]
    caplog.set_level(logging.INFO)
    for level, said in ((2, "level 2, from the finished codes (it had none)"),
                        (1, "level 1, from the finished codes (it held level 2)")):
        caplog.clear()
        assert km_shard(folder, spec, level, streamed=streamed) is None
        assert said in caplog.text and "nothing to do" not in caplog.text
        written = files(folder)
        assert written == written_with(tmp_path / f"with {level}", spec, level, streamed)
        assert written[NAME + CODES.array] == codes
    km = folder / (NAME + CODES.km)
    stamp = km.stat().st_mtime_ns
    caplog.clear()
    assert km_shard(folder, spec, None, streamed=streamed) is None
    assert f"{km} (level 1) is kept as it is: no --km asks for none; nothing to do" in caplog.text
    assert files(folder) == written and km.stat().st_mtime_ns == stamp
    caplog.clear()
    assert km_shard(folder, spec, 1, streamed=streamed) is None
    assert "nothing to do (--overwrite: do it again)" in caplog.text and km.stat().st_mtime_ns == stamp
    km.unlink()
    caplog.clear()
    assert km_shard(folder, spec, 1, streamed=streamed) is None
    assert "level 1, from the finished codes (it was missing)" in caplog.text and files(folder) == written


def test_a_km_write_that_fails_leaves_a_record_that_asks_for_it_again(tmp_path, spec, monkeypatch, caplog):
    """A full disk while a finished shard's .km is written again: one line to free space, no half-written file, the
    record naming no level (never one the .km does not hold), and the next run writes it whole."""
    folder = tmp_path / "shard"
    km_shard(folder, spec, 1)
    held = (folder / (NAME + CODES.km)).read_text()
    lines = code_shard._km_text

    def full_disk(*args):
        yield next(lines(*args))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(code_shard, "_km_text", full_disk)
    with pytest.raises(TransientFault, match=r"No space left on device writing .*train_0_1\.km: free space in "):
        km_shard(folder, spec, 2)
    record = json.loads((folder / (NAME + CODES.meta)).read_text())
    assert record["km_level"] is None and (folder / (NAME + CODES.km)).read_text() == held
    assert not list(folder.glob("*.tmp"))
    monkeypatch.undo()
    caplog.set_level(logging.INFO)
    assert km_shard(folder, spec, 1) is None and "level 1, from the finished codes (it had none)" in caplog.text
    assert files(folder) == written_with(tmp_path / "with 1", spec, 1)


def test_a_shard_in_progress_keeps_its_km_level_and_the_refusal_says_how_to_get_another(tmp_path, spec):
    """A .km level other than the one a shard in progress began with is refused, naming the flag as it is typed, and
    saying that the finished shard takes the new level; any other setting is refused without that."""
    folder = tmp_path / "shard"
    km_shard(folder, spec, 1, end=2)
    before = files(folder)
    for level, change in ((2, "--km 1 -> --km 2"), (None, "--km 1 -> no --km")):
        with pytest.raises(BadInputError, match=re.escape(
                f"begun with other settings ({change}): rerun with those, then with these, which a finished shard "
                "takes from its rows, or pass --overwrite")):
            km_shard(folder, spec, level)
    with pytest.raises(BadInputError, match=r"begun with other settings \(step: 1 -> 2\): rerun with those, or pass"):
        CodeShard.begin(folder, NAME, spec, {**settings(km_level=1), "step": 2}, overwrite=False, redo="again",
                        root="/audio")
    assert files(folder) == before
    km_shard(folder, spec, 1)  # the level it began with: it goes on and finishes
    assert km_shard(folder, spec, 2) is None
    assert files(folder) == written_with(tmp_path / "with 2", spec, 2)
