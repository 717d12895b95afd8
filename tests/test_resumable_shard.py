"""data/resumable_shard.py's ShardWriter in this process: a commit is what a resumed writer goes on from, what was
written after it is cut away, a changed setting is refused, and a finished shard is left as it is. (The tools' own
kills and resumes are tests/test_tool_faults.py's and tests/test_audio_to_codes.py's, in their processes.)"""
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from data.resumable_shard import ShardWriter
from data.shard_layout import FEATURE_DUMP, PARTIAL
from errors import BadInputError

pytestmark = pytest.mark.timeout(60)
NAME = "train_0_1"
LOG = logging.getLogger("test")
SETTINGS = {"split": "train", "nshard": 1, "rank": 0, "feature": "demo"}
STREAMS = {FEATURE_DUMP.lengths: "", FEATURE_DUMP.keys: "/audio\n", FEATURE_DUMP.skipped: ""}


def begin(folder: Path, settings: dict = SETTINGS, **kwargs) -> ShardWriter | None:
    return ShardWriter.begin(folder, NAME, FEATURE_DUMP, settings, overwrite=kwargs.pop("overwrite", False), log=LOG,
                             redo="write the shard again", width=3, dtype="float32", streams=STREAMS, **kwargs)


def utterance(i: int) -> np.ndarray:
    return np.full((i + 2, 3), float(i), dtype=np.float32)


def add(writer: ShardWriter, first: int, end: int) -> None:
    """Utterances first..end-1, their rows and lines."""
    for i in range(first, end):
        writer.write(utterance(i))
        writer.append(FEATURE_DUMP.lengths, f"{i + 2}\n")
        writer.append(FEATURE_DUMP.keys, f"u{i}.wav\t{160 * (i + 2)}\n")


def committed_two(folder: Path) -> None:
    """Utterances 0 and 1 written and committed, the writer closed: a shard stopped after its first commit."""
    writer = begin(folder)
    add(writer, 0, 2)
    writer.commit(2)
    writer.close()


def finished_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def finish(writer: ShardWriter) -> Path:
    return writer.finish({FEATURE_DUMP.meta: json.dumps({**SETTINGS, "utterances": 5}) + "\n"})


@pytest.fixture
def unbroken(tmp_path) -> dict[str, bytes]:
    """The files of the shard written in one go: utterances 0-4, committed after 2 and after 5."""
    folder = tmp_path / "unbroken"
    with begin(folder) as writer:
        add(writer, 0, 2)
        writer.commit(2)
        add(writer, 2, 5)
        writer.commit(5)
        finish(writer)
    return finished_files(folder)


def test_a_resumed_writer_goes_on_from_its_commit_and_ends_with_the_bytes_of_an_unbroken_one(tmp_path, unbroken):
    folder = tmp_path / "out"
    writer = begin(folder)
    add(writer, 0, 2)
    writer.commit(2)
    add(writer, 2, 4)  # written, never committed: a kill here
    writer.close()
    partial = folder / (NAME + FEATURE_DUMP.array + PARTIAL)
    record = json.loads((folder / (NAME + FEATURE_DUMP.progress)).read_text())
    assert (record["done"], record["rows"], record["commits"], record["settings"]) == (2, 5, 1, SETTINGS)
    written = partial.stat().st_size
    with begin(folder) as resumed:
        assert (resumed.done, resumed.rows, resumed.commits) == (2, 5, 1)
        rows_dropped = 4 + 5  # utterances 2 and 3
        lines_dropped = len("4\n5\n") + len("u2.wav\t640\nu3.wav\t800\n")
        assert resumed.dropped_bytes == rows_dropped * 3 * 4 + lines_dropped
        assert partial.stat().st_size == written - rows_dropped * 3 * 4  # cut back to the commit
        add(resumed, 2, 5)
        resumed.commit(5)
        array = finish(resumed)
    assert finished_files(folder) == unbroken
    assert np.load(array).shape == (2 + 3 + 4 + 5 + 6, 3)
    assert not partial.exists() and not (folder / (NAME + FEATURE_DUMP.progress)).exists()


def test_a_shard_begun_with_other_settings_is_refused_and_left_as_it_is(tmp_path):
    folder = tmp_path / "out"
    committed_two(folder)
    before = finished_files(folder)
    with pytest.raises(BadInputError, match=r"begun with other settings \(feature: 'demo' -> 'fbank'\).*--overwrite"):
        begin(folder, {**SETTINGS, "feature": "fbank"})
    assert finished_files(folder) == before
    with begin(folder, {**SETTINGS, "feature": "fbank"}, overwrite=True) as again:  # --overwrite starts it over
        assert (again.done, again.rows) == (0, 0)


def test_a_finished_shard_is_left_alone_and_one_of_other_settings_refused(tmp_path, unbroken, caplog):
    folder = tmp_path / "out"
    with begin(folder) as writer:
        add(writer, 0, 5)
        writer.commit(5)
        finish(writer)
    caplog.set_level(logging.INFO)
    assert begin(folder) is None
    assert f"{NAME} is complete" in caplog.text
    assert finished_files(folder) == unbroken
    with pytest.raises(BadInputError, match=r"was written with other settings \(rank: 0 -> 1\)"):
        begin(folder, {**SETTINGS, "rank": 1})
    assert finished_files(folder) == unbroken


def test_a_commit_lost_by_the_disk_is_refused_not_written_over(tmp_path):
    """A partial file shorter than its last commit: the disk lost confirmed writes, and nothing is guessed."""
    folder = tmp_path / "out"
    committed_two(folder)
    partial = folder / (NAME + FEATURE_DUMP.lengths + PARTIAL)
    partial.write_text("2\n")
    with pytest.raises(BadInputError, match="fewer than its last commit"):
        begin(folder)


def test_a_second_writer_of_the_shard_is_refused_while_the_first_holds_it(tmp_path):
    folder = tmp_path / "out"
    with begin(folder) as writer:
        add(writer, 0, 1)
        with pytest.raises(BadInputError, match="is being written"):
            begin(folder)
        writer.commit(1)
    assert json.loads((folder / (NAME + FEATURE_DUMP.progress)).read_text())["done"] == 1
