"""The files of a shard, by name only (no file is opened here): `ShardLayout` names every file of one kind of
shard, NAME + an extension each, and FEATURE_DUMP (tools.extract's fairseq dump) and CODES (tools.encode's and
tools.tokenize's codes) are the two kinds. Every module that reads or writes a shard takes its names from here
(data/resumable_shard.py writes them; data/stores.py, data/manifests.py, data/codes_parquet.py read them).

A finished shard NAME is its array (`NAME.npy`, `NAME.codes.npy`), its metadata (`.json`, `.codes.json`) and its
text files (`.len`, `.tsv`, `.skipped`, and for codes `.km` and `.codes.parquet`). While it is written, each array
and text stream lies under its name + PARTIAL, beside a progress file (`NAME.codes.progress`) that records what is
committed; a hidden lock file (`.NAME.codes.lock`) is held by its one writer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PARTIAL = ".partial"  # a file being written: NAME + extension + PARTIAL until the shard is finished


@dataclass(frozen=True)
class ShardLayout:
    """The files of one kind of shard, NAME + an extension each: every stream a tool writes is named here, and
    nowhere else."""

    array: str  # the rows: ".npy", ".codes.npy"
    meta: str  # JSON: the settings and counts
    lengths: str  # a count a line per utterance: its frames, or its code frames
    keys: str  # the utterances' manifest: the source's root, then key<TAB>samples a line
    skipped: str  # key<TAB>reason a line, for each utterance left out
    km: str | None = None  # fairseq's label lines of one level (--km)
    parquet: str | None = None  # a row per utterance (--parquet: data/codes_parquet.py)
    frames: str | None = None  # feature frames per utterance, kept while writing only
    # held while a writer checks the folder's other shards and starts its own (one codec a folder); None: no such check
    folder_lock: str | None = None

    @property
    def stem(self) -> str:
        return self.array[: -len(".npy")]

    @property
    def progress(self) -> str:
        return self.stem + ".progress"

    def lock_path(self, folder: Path, name: str) -> Path:
        """The writer lock's file: hidden (`.NAME.codes.lock`), since it stays when the writer is gone."""
        return folder / f".{name}{self.stem}.lock"

    @property
    def texts(self) -> tuple[str, ...]:
        """Every file a finished shard may have beside its array and metadata."""
        return tuple(ext for ext in (self.lengths, self.keys, self.skipped, self.km, self.parquet) if ext)

    @property
    def scratch(self) -> tuple[str, ...]:
        """The streams kept while writing only."""
        return (self.frames,) if self.frames else ()

    @property
    def finished(self) -> tuple[str, ...]:
        return (self.array, self.meta, *self.texts)


FEATURE_DUMP = ShardLayout(".npy", ".json", ".len", ".tsv", ".skipped")  # tools.extract (decode: .npy, .len)
CODES = ShardLayout(".codes.npy", ".codes.json", ".codes.len", ".codes.tsv", ".codes.skipped", km=".km",
                    parquet=".codes.parquet", frames=".codes.frames",
                    folder_lock=".codes.codec.lock")  # tools.encode, tools.tokenize
