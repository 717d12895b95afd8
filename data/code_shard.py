"""A shard of RVQ codes written as it is encoded, and resumed after a crash from what was durably written.

While shard NAME is being encoded, two files lie in the output folder:

- `NAME.codes.npy.partial`: a .npy whose header already holds the shard's final shape [code frames, levels]
  (known from the features' lengths before anything is encoded), then the rows written so far;
- `NAME.codes.progress`: JSON with the settings the shard is encoded with and the utterances and code rows
  committed. A commit fsyncs the .partial, then replaces this file atomically.

Opened again with the same settings, the .partial is cut back to the committed rows (whatever a killed
process wrote after its last commit is dropped) and encoding goes on from the next utterance. When every
row is in, `finish` writes the shard's metadata files and renames the .partial to NAME.codes.npy, last, as
data/dump_writer.py publishes a dump: a .codes.npy on disk is complete, with its .codes.json beside it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from data.dump_writer import fsync_folder, npy_header, publish, write_temporary
from errors import BadInputError

CODES, META, PARTIAL, PROGRESS = ".codes.npy", ".codes.json", ".codes.npy.partial", ".codes.progress"
FINISHED = (CODES, ".codes.len", META, ".codes.tsv")  # what tools.encode writes for a finished shard


def finished_meta(folder: Path, name: str) -> dict | None:
    """The .codes.json of a finished shard NAME in `folder`, or None when the shard is not finished."""
    if not (folder / (name + CODES)).is_file():
        return None
    return _read_json(folder / (name + META)) or {}


def changed_settings(recorded: dict, settings: dict) -> str:
    """`key: recorded -> now` for each setting that differs from what was recorded ('' when none does)."""
    return ", ".join(f"{key}: {recorded.get(key)!r} -> {value!r}" for key, value in settings.items()
                     if recorded.get(key) != value)


def remove_shard(folder: Path, name: str) -> None:
    """Every file of shard NAME, finished or not."""
    for ext in (*FINISHED, PARTIAL, PROGRESS):
        (folder / (name + ext)).unlink(missing_ok=True)


class CodeShardWriter:
    """Rows of codes appended to NAME.codes.npy.partial; `commit` makes those written so far durable.

    `utterances` and `rows` are what is committed: after opening, what an earlier run with the same
    `settings` committed (0 when it starts anew); `dropped_bytes` what that run wrote past its last commit."""

    def __init__(self, folder: Path, name: str, settings: dict, rows: int, levels: int, dtype: np.dtype):
        self.folder, self.name, self.settings, self.total_rows = folder, name, settings, rows
        self.partial, self.progress = folder / (name + PARTIAL), folder / (name + PROGRESS)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.levels, self.header = levels, npy_header(rows, levels, dtype=self.dtype.name)
        self.utterances, self.rows, self.dropped_bytes = self._resume()
        self.written = self.rows
        self.file = open(self.partial, "r+b")
        self.file.seek(self._offset(self.rows))

    def _offset(self, rows: int) -> int:
        return len(self.header) + rows * self.levels * self.dtype.itemsize

    def _resume(self) -> tuple[int, int, int]:
        """(utterances, rows, bytes dropped) committed by an earlier run with these settings, the .partial cut
        back to them; else a new .partial holding only its header."""
        committed = _read_json(self.progress)
        if committed is not None and self.partial.is_file():
            differ = changed_settings(committed.get("settings", {}), self.settings)
            if differ:
                raise BadInputError(f"{self.partial} was begun with other settings ({differ}): rerun with those, "
                                    "or pass --overwrite to encode the shard again")
            size, keep = self.partial.stat().st_size, self._offset(committed["rows"])
            if size < keep:
                raise BadInputError(f"{self.partial} has {size} bytes, fewer than its last commit ({keep}): the "
                                    "disk lost confirmed writes; pass --overwrite to encode the shard again")
            with open(self.partial, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
            return committed["utterances"], committed["rows"], size - keep
        self.progress.unlink(missing_ok=True)
        with open(self.partial, "wb") as f:
            f.write(self.header)
        return 0, 0, 0

    def write(self, codes: np.ndarray) -> None:
        """Append [rows, levels] codes, handed to the OS (a killed process leaves them), not yet durable."""
        codes = np.ascontiguousarray(codes, dtype=self.dtype)
        if codes.ndim != 2 or codes.shape[1] != self.levels or self.written + len(codes) > self.total_rows:
            raise ValueError(f"codes of shape {codes.shape} do not fit {self.partial} ({self.written} of "
                             f"{self.total_rows} rows x {self.levels} written)")
        self.file.write(codes.tobytes())
        self.file.flush()
        self.written += len(codes)

    def commit(self, utterances: int) -> None:
        """Make every row written so far durable, the codes of the shard's first `utterances` utterances."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.utterances, self.rows = utterances, self.written
        record = {"utterances": utterances, "rows": self.rows, "settings": self.settings}
        os.replace(write_temporary(self.progress, json.dumps(record) + "\n"), self.progress)
        fsync_folder(self.folder)

    def finish(self, texts: dict[str, str | Iterable[str]]) -> Path:
        """Write the metadata files (extension -> text) and rename the .partial to NAME.codes.npy; returns it."""
        if self.rows != self.total_rows or self.written != self.rows:
            raise RuntimeError(f"{self.partial}: {self.rows} rows committed, {self.written} written, "
                               f"{self.total_rows} expected")
        self.file.close()
        pairs = [(write_temporary(self.folder / (self.name + ext), text), self.folder / (self.name + ext))
                 for ext, text in texts.items()]
        final = self.folder / (self.name + CODES)
        publish(pairs, (self.partial, final))
        self.progress.unlink()
        return final

    def close(self) -> None:
        """Stop writing; what was committed stays for the next run to resume."""
        if not self.file.closed:
            self.file.close()


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
