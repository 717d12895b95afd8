"""A finished code shard as parquet, for language-model pipelines: `NAME.codes.parquet` beside `NAME.codes.npy`,
read as it is by `datasets.load_dataset("parquet", data_files=...)` or any parquet reader.

One row per utterance, in the shard's order:

- `key` (string): the utterance's first field in `NAME.codes.tsv` (its audio file, relative to the root on the
  .tsv's first line, or its key in a tar, parquet or Lhotse source: data/audio/sources.py); with no .codes.tsv
  (a dump not written by tools.extract), its index in the split as tools.encode numbers it (`first_utterance`
  of NAME.codes.json plus its place in the shard);
- `level_1` ... `level_Q` (list of int16, or int32 when the codebook has more than 32768 codes): its codes at
  each level, one per code frame.

The file's metadata (`rvq_codes`) hold the codec and codes settings of NAME.codes.json and the .tsv's root.
Written from the finished files, streamed: the .npy memory-mapped, the .len and .tsv read line by line, a row
group of at most ROW_GROUP_UTTERANCES utterances and ROW_GROUP_FRAMES code frames at a time, so memory stays
the same whatever the shard's size; into `NAME.codes.parquet.tmp`, fsynced and renamed into place when complete
(data/dump_writer.py publish): a killed write leaves no file under the final name, and the same command run
again writes it. pyarrow is optional (requirements-sources.txt), imported only here, when a parquet is written.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path

import numpy as np

from data.dump_writer import publish
from data.resumable_shard import finished_meta
from data.shard_layout import CODES, ShardLayout
from data.writer_lock import WriterLock
from errors import SOURCES_INSTALL, BadInputError

ROW_GROUP_UTTERANCES = 1024
ROW_GROUP_FRAMES = 1 << 22  # 4M code frames: 64 MB of int16 codes at 8 levels, a row group's bound in memory
log = logging.getLogger("parquet")
# the settings of NAME.codes.json that say what the codes are, kept in the parquet's metadata
DESCRIBED = ("checkpoint", "step", "codec_digest", "levels", "codebook_size", "downsample", "dtype", "split",
             "rank", "nshard", "features")


def require_pyarrow() -> None:
    """BadInputError naming the install line when pyarrow cannot be imported (--parquet checks it before work)."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise BadInputError(f"--parquet writes codes with pyarrow, which is not installed: {SOURCES_INSTALL}") \
            from None


def write_codes_parquet(folder: Path, name: str, layout: ShardLayout = CODES, *,
                        group_utterances: int = ROW_GROUP_UTTERANCES, group_frames: int = ROW_GROUP_FRAMES) -> Path:
    """Write NAME.codes.parquet from finished code shard NAME in `folder` (the caller holds the shard's lock: it is
    data/resumable_shard.py ShardWriter.write_parquet); returns its path. A shard whose files disagree (rows,
    lengths, keys) is a BadInputError naming them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    array_path, len_path = folder / (name + layout.array), folder / (name + layout.lengths)
    tsv_path, final = folder / (name + layout.keys), folder / (name + layout.parquet)
    meta = finished_meta(folder, name, layout)
    if meta is None or not len_path.is_file():
        raise BadInputError(f"{array_path} or {len_path.name} is missing: the shard is not finished")
    codes = np.load(array_path, mmap_mode="r")
    if codes.ndim != 2 or codes.dtype.kind != "i":
        raise BadInputError(f"{array_path} holds {codes.dtype} of shape {codes.shape}, not [code frames, levels] "
                            "integer codes")
    dtype = pa.from_numpy_dtype(np.dtype(codes.dtype.name))
    levels = [f"level_{q + 1}" for q in range(codes.shape[1])]
    schema = pa.schema([("key", pa.string()), *((level, pa.list_(dtype)) for level in levels)])
    with open(tsv_path, encoding="utf-8") if tsv_path.is_file() else contextlib.nullcontext() as tsv:
        root = tsv.readline().rstrip("\n") if tsv else None
        described = {k: meta[k] for k in DESCRIBED if k in meta}
        described.update(shard=name, root=root, key=f"the {layout.keys}'s first field (a file under root, or the "
                         "source's key)" if tsv else "the utterance's index in the split (tools.encode's numbering)")
        schema = schema.with_metadata({"rvq_codes": json.dumps(described)})
        tmp = final.with_name(final.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                writer = pq.ParquetWriter(f, schema)
                row = 0
                utterances = _utterances(len_path, tsv, int(meta.get("first_utterance", 0)), tsv_path)
                for keys, lengths in utterance_groups(utterances, group_utterances, group_frames):
                    end = row + int(lengths.sum())
                    if end > codes.shape[0]:
                        raise BadInputError(f"{len_path} lists more code frames than the {codes.shape[0]} rows of "
                                            f"{array_path}")
                    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
                    block = np.asarray(codes[row:end])
                    columns = [pa.array(keys, pa.string())]
                    columns += [pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(block[:, q]), dtype))
                                for q in range(len(levels))]
                    writer.write_table(pa.Table.from_arrays(columns, schema=schema))
                    row = end
                writer.close()
                if row != codes.shape[0]:
                    raise BadInputError(f"{len_path} lists {row} code frames; {array_path} has {codes.shape[0]}")
                f.flush()
                os.fsync(f.fileno())
            publish([], (tmp, final))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    log.info("wrote %d code frames of %s, %d levels, a row per utterance keyed by %s, to %s", row, name,
             len(levels), f"its {layout.keys} line" if root is not None else "its index", final)
    return final


def complete_codes_parquet(folder: Path, name: str, layout: ShardLayout = CODES) -> Path | None:
    """For a shard found finished: write NAME.codes.parquet when it is missing (a run killed while writing it),
    under the shard's lock; returns its path, or None when it was there."""
    final = folder / (name + layout.parquet)
    with WriterLock(layout.lock_path(folder, name), f"shard {folder / (name + layout.array)}"):
        if final.is_file() or finished_meta(folder, name, layout) is None:  # there, or removed since by --overwrite
            return None
        log.info("%s is missing: writing it from the finished shard (--parquet)", final)
        return write_codes_parquet(folder, name, layout)


def _utterances(len_path: Path, tsv, first: int, tsv_path: Path) -> Iterator[tuple[str, int]]:
    """(key, code frames) of each utterance, from the .len and the .tsv (read line by line), or the index."""
    with open(len_path) as lens:
        counts = (line for line in lens if line.strip())
        keys = (line.split("\t")[0] for line in tsv if line.strip()) if tsv else None
        if keys is None:
            for i, count in enumerate(counts):
                yield str(first + i), int(count)
            return
        for key, count in zip_longest(keys, counts):
            if key is None or count is None:
                raise BadInputError(f"{tsv_path} and {len_path} list different numbers of utterances")
            yield key.rstrip("\n"), int(count)


def utterance_groups(utterances: Iterator[tuple[str, int]], most: int,
                     frames: int) -> Iterator[tuple[list[str], np.ndarray]]:
    """(keys, lengths) of consecutive utterances: at most `most` of them and `frames` code frames (an utterance
    longer than that alone). Also how a finished shard's .km is written again (rvq_tokenizer/code_shard.py)."""
    keys, lengths, total = [], [], 0
    for key, n in utterances:
        if keys and (len(keys) == most or total + n > frames):
            yield keys, np.array(lengths, dtype=np.int64)
            keys, lengths, total = [], [], 0
        keys.append(key)
        lengths.append(n)
        total += n
    if keys:
        yield keys, np.array(lengths, dtype=np.int64)

