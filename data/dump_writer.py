"""Writing a fairseq dump (the format data/stores.py reads), so that a crash leaves nothing a reader would take.

Every file is written under a temporary name (`NAME.tmp`), fsynced, and renamed
into place by `publish`, the .npy last: a .npy on disk always has its .len
beside it. A rename replaces the file it lands on; nothing is unlinked first.
`shard_range` is how a rank of NSHARD takes its contiguous share of the items,
as in fairseq's examples/hubert/simple_kmeans. `output_folder` makes the folder a
command writes into (the trainer's and every tool's), or says in one line why it
cannot: a BadInputError before anything is written.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from errors import BadInputError


def output_folder(folder: Path, what: str) -> Path:
    """`folder` (named `what` in a message: a flag, or "the output folder") made with its parents; BadInputError
    when it is a file, or cannot be made (a parent that is a file, no permission)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInputError(f"{what} {folder} is a file, not a folder: give a folder to write into") from None
    except OSError as e:
        raise BadInputError(f"{what} {folder} cannot be made or written ({e.strerror}): give a folder this process "
                            "can write") from None
    return folder


def cache_folder() -> Path:
    """$XDG_CACHE_HOME (or ~/.cache)/rvq_seamless: what the tools keep between runs (choices, fits), each file
    named by what it depends on."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "rvq_seamless"


def shard_range(total: int, nshard: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of `total` items, as fairseq's simple_kmeans splits a manifest."""
    return round(total / nshard * rank), round(total / nshard * (rank + 1))


DUMP_DTYPES = ("float32", "float16")  # float16: half the disk and IO, read through the same vectorised path


def npy_header(rows: int, dim: int, size: int = 128, dtype: str = "float32") -> bytes:
    """A .npy v1.0 header for [rows, dim] of `dtype`, padded to `size` bytes so it can be rewritten in place."""
    text = "{'descr': '%s', 'fortran_order': False, 'shape': (%d, %d), }" % (np.dtype(dtype).newbyteorder("<").str,
                                                                            rows, dim)
    pad = size - 10 - len(text) - 1
    if pad < 0:
        raise ValueError(f"shape ({rows}, {dim}) does not fit a {size}-byte header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", size - 10) + text.encode("latin1") + b" " * pad + b"\n"


class NpyRowWriter:
    """Rows streamed into a .npy under a temporary name: the row count is written into the header at the end."""

    def __init__(self, path: Path, dim: int, dtype: str = "float32"):
        self.path, self.dim, self.rows, self.dtype = path, dim, 0, np.dtype(dtype).newbyteorder("<")
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.file.write(npy_header(0, dim, dtype=dtype))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        assert rows.ndim == 2 and rows.shape[1] == self.dim, rows.shape
        self.file.write(rows.tobytes())
        self.rows += rows.shape[0]

    def finish(self) -> Path:
        """Close the temporary file with its final header; returns it (the caller renames it)."""
        self.file.seek(0)
        self.file.write(npy_header(self.rows, self.dim, dtype=self.dtype.name))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.tmp

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def len_text(counts: list[int]) -> str:
    """A .len file's text: one count per line."""
    return "".join(f"{n}\n" for n in counts)


def write_temporary(path: Path, text: str | Iterable[str]) -> Path:
    """`text` (a string, or pieces of one written as they come) written and fsynced to `path`.tmp; returns the
    temporary (the caller publishes it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:  # a name's non-UTF-8 bytes kept as they were
        if isinstance(text, str):
            f.write(text)
        else:
            f.writelines(text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def publish(pairs: list[tuple[Path, Path]], array: tuple[Path, Path]) -> None:
    """Rename temporaries into place, the .npy last, so a .npy on disk always has its .len beside it. Each rename
    replaces what was there; nothing is deleted first (the tools hold the shard's lock and refuse an existing shard
    without --overwrite, which removes it before any work, so no older .npy is left to sit beside a new .len)."""
    for tmp, final in [*pairs, array]:
        os.replace(tmp, final)
    fsync_folder(array[1].parent)


def fsync_folder(folder: Path) -> None:
    """Make the renames in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
