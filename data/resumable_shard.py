"""A shard written as it is computed and resumed after a crash from what was durably written: the one home of a
shard of tools.extract (a feature dump), tools.encode and tools.tokenize (codes), from its start to its end, for
the files data/shard_layout.py names. `ShardWriter.begin` takes the shard's lock and checks it against the folder
(one count of shards a split, one codec a code folder, the settings it was begun with), `write_windows` writes a
window of audio files at a time, `commit` makes it durable, `finish` (and `finish_utterances`, the end of an
audio shard) publishes it. A code shard's streams are rvq_tokenizer/code_shard.py's, on top of this writer.

While shard NAME is written, these lie in the output folder (a code shard's names; a feature dump's drop
the `.codes`):

- `NAME.codes.npy.partial`: a .npy of [rows, width] whose header is rewritten with the final row count at
  the end, then the rows written so far;
- `NAME.EXT.partial`: each text stream (`.codes.len`, `.km`, ...): lines appended with the rows they describe;
- `NAME.codes.progress`: JSON with the settings the shard is written with, the inputs done, the rows and
  each stream's bytes, all committed. A commit fsyncs every partial, then replaces this file atomically.

Opened again with the same settings, every .partial is cut back to its committed size (what a killed
process wrote after its last commit is dropped) and the work goes on from the next input. When every
input is in, `finish` writes the metadata files, renames the streams and then the array to their final
names, the array last (data/dump_writer.py's publish): an array on disk is complete, its files beside it.
`claim_shard` is how a tool starts a shard: the writer lock (data/writer_lock.py), then a finished shard
is left as it is, a shard written with other settings or by another tool refused, `--overwrite` honoured.
`check_split_shards` holds a folder to one count of shards per split (finished or begun): shards of two counts
would hold the split's utterances twice.

A full disk (or quota, or a file-size limit) while a ShardWriter writes ends the tool with one line naming
the folder, the space free there and the space the shard still needs, exit 1 (TransientFault): what was
committed stays, and the same command resumes from it once there is room.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import glob
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from data.dump_writer import fsync_folder, npy_header, output_folder, publish, write_temporary
from data.setting_changes import changes
from data.shard_layout import FEATURE_DUMP, PARTIAL, ShardLayout
from data.writer_lock import WriterLock
from errors import BadInputError, TransientFault

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, past a file-size limit


def finished_meta(folder: Path, name: str, layout: ShardLayout) -> dict | None:
    """The metadata of a finished shard NAME in `folder` ({} when its JSON is missing or unreadable), or None
    when there is no finished shard."""
    if not (folder / (name + layout.array)).is_file():
        return None
    return _read_json(folder / (name + layout.meta)) or {}


def recorded_settings(path: Path) -> dict | None:
    """The settings a shard's progress file (its `settings`) or finished metadata (the record itself) holds; None
    when the file is missing or unreadable."""
    record = _read_json(path)
    return None if record is None else record.get("settings", record)


def shard_settings(folder: Path, name: str, layout: ShardLayout) -> dict | None:
    """The settings shard NAME in `folder` was finished, or else begun, with; None: no such shard, or unreadable."""
    finished = finished_meta(folder, name, layout)
    if finished is not None:
        return finished
    return recorded_settings(folder / (name + layout.progress))


def split_shards(folder: Path, split: str, layout: ShardLayout, *, begun: bool = True) -> dict[int, list[str]]:
    """Shard count -> the files in `folder` of split SPLIT's shards of that count, sorted: each finished shard's array
    and, with `begun`, each begun shard's progress file."""
    ends = "|".join(re.escape(ext) for ext in ((layout.array, layout.progress) if begun else (layout.array,)))
    pattern = re.compile(rf"^{re.escape(split)}_\d+_(\d+)(?:{ends})$")
    found: dict[int, list[str]] = {}
    for path in sorted(folder.glob(f"{glob.escape(split)}_*_*")) if folder.is_dir() else []:
        if match := pattern.match(path.name):
            found.setdefault(int(match.group(1)), []).append(path.name)
    return found


def check_split_shards(folder: Path, split: str, nshard: int, layout: ShardLayout = FEATURE_DUMP,
                       source_listing: dict | None = None, name: str = "") -> None:
    """BadInputError when `folder` holds shards of split SPLIT, finished or begun, in another count than `nshard`: the
    split's utterances would lie there twice (a dump of two counts cannot be read, data/stores.py; a glob over
    code shards, as their parquet is read, counts them twice). With `source_listing` (the whole source a shard of
    audio is cut from: tools/audio_shard.py), also when another shard of the split was cut from another
    (`other_source`) than shard NAME, the one to write."""
    found = split_shards(folder, split, layout)
    others = [name for count, names in sorted(found.items()) if count != nshard for name in names]
    if others:
        raise BadInputError(f"{folder} already holds split '{split}' in other shards ({', '.join(others[:3])}"
                            f"{' ...' if len(others) > 3 else ''}): a split of {nshard} shards beside them would hold "
                            "its utterances twice; write elsewhere, or remove them")
    if source_listing is None:
        return
    siblings = {file[: -len(ext)] for file in found.get(nshard, []) for ext in (layout.array, layout.progress)
                if file.endswith(ext)} - {name}
    for sibling in sorted(siblings):
        recorded = (shard_settings(folder, sibling, layout) or {}).get("source_listing")
        differs = other_source(recorded, source_listing)
        if differs:
            raise BadInputError(
                f"{folder / sibling} was cut from another list of the source than {name} ({differs}): the shards of "
                f"split '{split}' would miss some of its utterances and hold others twice. The source changed between "
                "the two starts (files still being copied?): once it is complete, write the split elsewhere, or "
                "again with --overwrite on every shard")


def other_source(recorded: dict | None, listing: dict) -> str:
    """How the whole source a shard recorded differs from `listing` ('' when it does not, or was not recorded):
    its count of units, or their names where both listed them."""
    if not recorded:
        return ""
    if (recorded.get("units"), recorded.get("unit")) != (listing["units"], listing["unit"]):
        return f"{recorded.get('units')} {recorded.get('unit')}(s) there, {listing['units']} {listing['unit']}(s) here"
    if recorded.get("listing") and listing["listing"] and recorded["listing"] != listing["listing"]:
        return f"{listing['units']} {listing['unit']}(s) on both, named otherwise"
    return ""


# settings a shard records since a later version: one begun or finished before records none, and is not held to them
LATER_SETTINGS = ("source_listing",)


# settings that a flag sets under another name, and that are absent without it: shown as the flag is typed
SETTING_FLAGS = {"km_level": "--km"}


def changed_settings(recorded: dict, settings: dict, ignore: Iterable[str] = ()) -> str:
    """`key: recorded -> now` for each setting that differs from what was recorded ('' when none does), those in
    `ignore` aside; one of SETTING_FLAGS as its flag, `--km 1 -> no --km`; one of LATER_SETTINGS that the record
    lacks is no change."""
    def word(key: str, was, now) -> str:
        if key not in SETTING_FLAGS:
            return f"{key}: {was!r} -> {now!r}"
        return " -> ".join(f"no {SETTING_FLAGS[key]}" if value is None else f"{SETTING_FLAGS[key]} {value}"
                           for value in (was, now))

    ignore = set(ignore)
    return ", ".join(changes(recorded, settings, word=word,
                             skip=lambda key: key in ignore or (key in LATER_SETTINGS and key not in recorded)))


def remove_shard(folder: Path, name: str, layout: ShardLayout) -> None:
    """Every file of shard NAME, finished or not, but its lock file (a writer that has just opened it would lock
    a file no longer there, and a third writer would create another)."""
    for ext in (*layout.finished, layout.progress):
        (folder / (name + ext)).unlink(missing_ok=True)
    for ext in (layout.array, *layout.texts, *layout.scratch):
        (folder / (name + ext + PARTIAL)).unlink(missing_ok=True)


def claim_shard(folder: Path, name: str, layout: ShardLayout, settings: dict, *, overwrite: bool,
                log: logging.Logger, redo: str, views: tuple[str, ...] = ()) -> WriterLock | None:
    """Lock shard NAME in `folder` (created) for this process, then: with `overwrite`, delete its files; a
    shard finished with these settings: None, said in the log (nothing to do); one finished with other
    settings, or whose array is there without its metadata: BadInputError naming the file and --overwrite.
    Settings in `views` choose a file the caller writes again from a finished shard's rows (a code shard's .km
    level: rvq_tokenizer/code_shard.py): a finished shard that differs in them only is finished too.
    Returns the held lock (the caller releases it). `redo`: what --overwrite does, in words."""
    output_folder(folder, "the output folder")
    array = folder / (name + layout.array)
    lock = WriterLock(layout.lock_path(folder, name), f"shard {array}").acquire()
    try:
        if overwrite:
            remove_shard(folder, name, layout)
            return lock
        finished = finished_meta(folder, name, layout)
        if finished is None:
            return lock
        if not finished:
            raise BadInputError(f"{array} exists without its {name}{layout.meta}: it was not written by this tool, "
                                f"and is left as it is; write elsewhere, or pass --overwrite to {redo}")
        differ = changed_settings(finished, settings, ignore=views)
        if differ:
            raise BadInputError(f"{array} was written with other settings ({differ}); it is left as it is: write "
                                f"elsewhere, or pass --overwrite to {redo}")
    except BaseException:
        lock.release()
        raise
    log.info("%s is complete (%s)%s", name, array,  # a view that differs: the caller says what it does
             "" if changed_settings(finished, settings) else f"; nothing to do (--overwrite: {redo})")
    lock.release()
    return None


def check_one_codec(folder: Path, name: str, layout: ShardLayout, settings: dict, *, overwrite: bool) -> None:
    """BadInputError when a code shard in `folder`, finished or in progress, came from another codec than
    `settings` name (its digest; its checkpoint file and step for a shard from before digests): one output holds
    the codes of one codec. Shard NAME's own files count unless `overwrite` is to delete them. Each shard was held
    to this when it began, so the first record read decides (a folder of many shards is not read whole)."""
    mine = (settings["checkpoint"], settings["step"], settings["codec_digest"])
    for path in sorted(folder.glob(f"*{layout.progress}")) + sorted(folder.glob(f"*{layout.meta}")):
        if overwrite and path.name in (name + layout.meta, name + layout.progress):
            continue
        record = recorded_settings(path)
        if not isinstance(record, dict) or "checkpoint" not in record:
            continue
        theirs = (record.get("checkpoint"), record.get("step"), record.get("codec_digest"))
        if (theirs[2] == mine[2]) if theirs[2] else (theirs[:2] == mine[:2]):
            return
        both = [f"{file} (step {step}{f', weights {digest}' if theirs[:2] == mine[:2] else ''})"
                for file, step, digest in (theirs, mine)]
        raise BadInputError(
            f"{path} holds codes of the codec {both[0]}; this command's codec is {both[1]}: one output holds the "
            "codes of one codec. Write into another folder"
            + (f", or give --checkpoint {theirs[0]}" if Path(theirs[0]).is_file() else "")
            + (" (the shard's own codes go with --overwrite)" if path.name.startswith(name + ".") else ""))


def _resumable_when_full(method: Callable) -> Callable:
    """A ShardWriter method whose disk-full OSError (DISK_FULL) becomes a TransientFault saying so in one line."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            raise TransientFault(self.out_of_space(e)) from None
    return guarded


def _size(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1e3:.1f} kB"


class ShardWriter:
    """One shard of a tool's output, from its start to its end: `begin` takes its lock and checks it against what
    the folder holds, `write` and `append` add rows and lines (`write_windows`, a window of audio files at a time),
    `commit` makes what was written durable, and `finish` publishes it.

    `done` (inputs), `rows` and `commits` are what is committed: after opening, what an earlier run with the
    same `settings` committed (0 when it starts anew); `dropped_bytes` what that run wrote past its last
    commit. `streams`: extension -> the text a new stream begins with (a manifest's root line, or ''). `rows`
    (the shard's rows) or `inputs` (its inputs), when known, size the space a full disk is told to free. `close`
    stops writing (what was committed stays) and lets go of the lock `begin` took."""

    lock: WriterLock | None = None

    @classmethod
    def begin(cls, folder: Path, name: str, layout: ShardLayout, settings: dict, *, overwrite: bool,
              log: logging.Logger, redo: str, **writer_args) -> ShardWriter | None:
        """Start (or resume) shard NAME in `folder` with `settings` (which name its `split` and `nshard`): its writer,
        holding the shard's lock, or None when the shard is finished already. The folder holds the split in one count
        of shards, cut from one listing of the source (check_split_shards), and for a layout with a `folder_lock` the
        codes of one codec (check_one_codec): those checks and the shard's start are made under the folder's lock,
        and the shard's settings are on disk once it has started, so two writers started at one instant with two
        codecs, or two shard counts, cannot both pass.
        `redo`: what --overwrite does, in words; `writer_args`: ShardWriter's (its `views`, claim_shard's too)."""
        output_folder(folder, "the output folder")
        fd = None
        if layout.folder_lock is not None:
            try:  # not a WriterLock: a writer refused here must leave the folder's files as they were, this one too
                fd = os.open(folder / layout.folder_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise BadInputError(f"cannot write into {folder} ({e.strerror}): give a folder this process can "
                                    "write") from e
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held for the checks and a shard's start: seconds at most
            check_split_shards(folder, settings["split"], settings["nshard"], layout, settings.get("source_listing"),
                               name)
            if layout.folder_lock is not None:
                check_one_codec(folder, name, layout, settings, overwrite=overwrite)
            lock = claim_shard(folder, name, layout, settings, overwrite=overwrite, log=log, redo=redo,
                               views=writer_args.get("views", ()))
            if lock is not None:
                try:
                    writer = cls(folder, name, layout, settings, **writer_args)
                except BaseException:
                    lock.release()
                    raise
                writer.lock = lock
                return writer
        finally:
            if fd is not None:
                os.close(fd)  # closing the descriptor lets go of the folder's lock
        return None

    @_resumable_when_full
    def __init__(self, folder: Path, name: str, layout: ShardLayout, settings: dict, *, width: int,
                 dtype: np.dtype | str, streams: dict[str, str] | None = None, rows: int | None = None,
                 inputs: int | None = None, views: tuple[str, ...] = ()):
        self.folder, self.name, self.layout, self.settings, self.views = folder, name, layout, settings, views
        self.width, self.total_rows, self.inputs = width, rows, inputs
        self.done = self.rows = self.commits = 0
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.partial = folder / (name + layout.array + PARTIAL)
        self.progress = folder / (name + layout.progress)
        self.stream_paths = {ext: folder / (name + ext + PARTIAL) for ext in (streams or {})}
        self.done, self.rows, self.commits, self.dropped_bytes = self._resume(streams or {})
        self.written = self.rows
        self.file = open(self.partial, "r+b")
        self.file.seek(self._offset(self.rows))
        self.streams = {ext: open(path, "a", encoding="utf-8", errors="surrogateescape")
                        for ext, path in self.stream_paths.items()}

    def _offset(self, rows: int) -> int:
        return len(npy_header(0, self.width)) + rows * self.width * self.dtype.itemsize

    def _resume(self, streams: dict[str, str]) -> tuple[int, int, int, int]:
        """(inputs done, rows, commits, bytes dropped) committed by an earlier run with these settings, every
        .partial cut back to its commit; else new partials holding only their headers."""
        committed = _read_json(self.progress)
        if committed is not None and "done" in committed:
            for ext, path in self.stream_paths.items():  # a stream this tool writes since the shard was begun
                if ext not in committed.get("sizes", {}) and not streams[ext] and not path.exists():
                    path.touch()  # goes on from here: what was done before it is kept, not begun again
        paths = [self.partial, *self.stream_paths.values()]
        if committed is not None and "done" in committed and all(p.is_file() for p in paths):
            differ = changed_settings(committed.get("settings", {}), self.settings)
            if differ:
                then = (", then with these, which a finished shard takes from its rows"
                        if not changed_settings(committed.get("settings", {}), self.settings, self.views) else "")
                raise BadInputError(f"{self.partial} was begun with other settings ({differ}): rerun with those{then}, "
                                    "or pass --overwrite to start the shard again")
            sizes = {**committed.get("sizes", {}), self.layout.array: self._offset(committed["rows"])}
            dropped = 0
            for ext, path in [(self.layout.array, self.partial), *self.stream_paths.items()]:
                size, keep = path.stat().st_size, sizes.get(ext, 0)
                if size < keep:
                    raise BadInputError(f"{path} has {size} bytes, fewer than its last commit ({keep}): the disk lost "
                                        "confirmed writes; pass --overwrite to start the shard again")
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
                dropped += size - keep
            return committed["done"], committed["rows"], committed.get("commits", 0), dropped
        self.progress.unlink(missing_ok=True)
        sizes = {}
        for ext, path, text in [(self.layout.array, self.partial, None),
                                *((ext, path, streams[ext]) for ext, path in self.stream_paths.items())]:
            with open(path, "wb") as f:
                f.write(npy_header(self.total_rows or 0, self.width, dtype=self.dtype.name) if text is None
                        else text.encode("utf-8", "surrogateescape"))
                f.flush()
                os.fsync(f.fileno())
                sizes[ext] = f.tell()
        self._record(0, 0, 0, sizes)  # the shard's settings are on disk from its start: another writer sees them
        return 0, 0, 0, 0

    def _record(self, done: int, rows: int, commits: int, sizes: dict) -> None:
        """Replace the progress file atomically with what is committed."""
        record = {"done": done, "rows": rows, "commits": commits, "sizes": sizes, "settings": self.settings}
        os.replace(write_temporary(self.progress, json.dumps(record) + "\n"), self.progress)
        fsync_folder(self.folder)

    @_resumable_when_full
    def write(self, rows: np.ndarray) -> None:
        """Append [n, width] rows, handed to the OS (a killed process leaves them), not yet durable."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.ndim != 2 or rows.shape[1] != self.width or (
                self.total_rows is not None and self.written + len(rows) > self.total_rows):
            raise ValueError(f"rows of shape {rows.shape} do not fit {self.partial} ({self.written} of "
                             f"{self.total_rows or '?'} rows x {self.width} written)")
        self.file.write(rows.tobytes())
        self.file.flush()
        self.written += len(rows)

    @_resumable_when_full
    def append(self, ext: str, text: str) -> None:
        """Append text to stream `ext`, not yet durable."""
        self.streams[ext].write(text)

    @_resumable_when_full
    def commit(self, done: int) -> None:
        """Make everything written so far durable: the rows and lines of the shard's first `done` inputs."""
        sizes = {}
        for ext, f in [(self.layout.array, self.file), *self.streams.items()]:
            f.flush()
            os.fsync(f.fileno())
            sizes[ext] = os.fstat(f.fileno()).st_size
        self.done, self.rows, self.commits = done, self.written, self.commits + 1
        self._record(done, self.rows, self.commits, sizes)

    def text(self, ext: str) -> str:
        """What stream `ext` holds."""
        self.streams[ext].flush()
        return self.stream_paths[ext].read_text(encoding="utf-8", errors="surrogateescape")

    @_resumable_when_full
    def finish(self, texts: dict[str, str | Iterable[str]]) -> Path:
        """Write the metadata files (extension -> text), publish the streams that are finished files and the
        array (its header now with the final row count), the array last; returns the array's path."""
        if self.written != self.rows or (self.total_rows is not None and self.rows != self.total_rows):
            raise RuntimeError(f"{self.partial}: {self.rows} rows committed, {self.written} written, "
                               f"{self.total_rows} expected")
        self.file.seek(0)
        self.file.write(npy_header(self.rows, self.width, dtype=self.dtype.name))
        self.file.flush()
        os.fsync(self.file.fileno())
        self._close_files()
        pairs = [(write_temporary(self.folder / (self.name + ext), text), self.folder / (self.name + ext))
                 for ext, text in texts.items()]
        pairs += [(path, self.folder / (self.name + ext)) for ext, path in self.stream_paths.items()
                  if ext in self.layout.texts]
        final = self.folder / (self.name + self.layout.array)
        publish(pairs, (self.partial, final))
        for ext, path in self.stream_paths.items():
            if ext not in self.layout.texts:
                path.unlink()
        self.progress.unlink()
        return final

    def discard(self) -> None:
        """Remove every file of the shard: nothing is kept (an extraction that kept no file)."""
        self._close_files()
        remove_shard(self.folder, self.name, self.layout)

    def close(self) -> None:
        """Stop writing, and let go of the shard's lock; what was committed stays for the next run to resume."""
        try:
            self._close_files()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def _close_files(self) -> None:
        for f in (getattr(self, "file", None), *getattr(self, "streams", {}).values()):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError as e:  # a full disk: what the buffer held was never committed, and is not needed
                    if e.errno not in DISK_FULL:
                        raise

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write_windows(self, pipeline, write: Callable[[object, object], None], before_commit: Callable[[int], None],
                      bar, prepare: Callable[[object], object] = lambda window: None) -> None:
        """Every window of `pipeline` (data/audio/pipeline.py FeatureWindows) from the first file not committed:
        `prepared = prepare(window)` on this thread (work for the device: tools.tokenize's codec), then on a writer
        thread, window after window in order, `window.ready()` (its features back on the host), `write(window,
        prepared)` and the commit, while this thread goes on with the next window: on a GPU the device then never
        waits for the disk. At most one window waits for the writer beside the one it writes. The writer's error (a
        full disk's TransientFault) is raised here, at the next hand-over or at the end, and nothing after the window
        that failed is written; an error here (a failed window, a stop) lets the writer write and commit the windows
        it was handed, then is raised. `before_commit(n)` runs between writing window n (counted from the shard's
        first) and committing it (where RVQ_FAULT's kill and hang fire); `bar` shows the input wait."""
        windows = pipeline.windows(self.done)
        handed: queue.Queue = queue.Queue(maxsize=1)
        failed: list[BaseException] = []

        stages = pipeline.stages  # where each thread's time goes (data/audio/pipeline.py STAGES), for the log

        def write_in_order() -> None:
            while (item := handed.get()) is not None:
                if failed:
                    continue  # a window after one that failed would be committed with it
                window, prepared = item
                try:
                    began = time.perf_counter()
                    window.ready()
                    wrote = time.perf_counter()
                    stages["waiting for the copy back"] += wrote - began
                    write(window, prepared)
                    before_commit(self.commits + 1)
                    self.commit(window.end)
                    stages["writing"] += time.perf_counter() - wrote
                    bar.set_postfix_str(f"input wait {pipeline.input_wait:.0f} s", refresh=False)
                except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                    failed.append(e)

        thread = threading.Thread(target=write_in_order, name="shard writer", daemon=True)
        thread.start()
        try:
            for window in windows:
                began = time.perf_counter()
                prepared = prepare(window)
                handing = time.perf_counter()
                stages["codec"] += handing - began
                while not failed:
                    try:
                        handed.put((window, prepared), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                stages["waiting for the writer"] += time.perf_counter() - handing
                if failed:
                    break
        finally:
            try:
                windows.close()
            finally:
                handed.put(None)
                thread.join()
        if failed:
            raise failed[0]

    def skip(self, log: logging.Logger, item) -> None:
        """A file skipped (data/audio/pipeline.py AudioFile): its line in the shard's skipped list, and a warning
        now, not at the shard's end (hours off in a large shard, and never reached by a run that is stopped)."""
        self.append(self.layout.skipped, item.skip_line)
        log.warning("skipped %s: %s", item.shown_key, item.skipped)

    def finish_utterances(self, log: logging.Logger, lengths: str, meta: Callable[[list[int], int], dict], *,
                          files: str, indent: int | None = None) -> tuple[Path, list[int], int] | None:
        """End a shard of audio files: (its array, each utterance's length as stream `lengths` holds them, the count
        of files skipped), its metadata `meta(lengths, skipped)` written and everything published. None, with the
        partial shard discarded and the reason logged, when every file was skipped; `files` names them in that
        message ("all 7 file(s) of shard 0/1")."""
        written = [int(n) for n in self.text(lengths).split()]
        skipped = self.text(self.layout.skipped).count("\n")
        if not written:
            self.discard()
            log.error("nothing written: %s were skipped (each named in a warning as it was skipped)", files)
            return None
        array = self.finish({self.layout.meta: json.dumps(meta(written, skipped), indent=indent) + "\n"})
        return array, written, skipped

    def out_of_space(self, e: OSError) -> str:
        """One line for a full disk (or quota, or file-size limit): the folder, what is free there, what the shard
        still needs as far as it is known, and that the same command resumes."""
        try:
            st = os.statvfs(self.folder)
            free = f"{_size(st.f_bavail * st.f_frsize)} free there"
        except OSError:
            free = "its free space unknown"
        total = self.total_rows
        if total is None and self.inputs and self.done:
            total = round(self.rows / self.done * self.inputs)  # at the rate of the inputs committed
        if total is None:
            need = "what it needs in all is known after its first commit"
        else:
            about = "" if self.total_rows is not None else "about "
            need = (f"its array needs {about}{_size(self._offset(total))} in all, "
                    f"{_size(self._offset(self.rows))} of it committed")
        limit = (" (a file-size limit: ulimit -f, or the file system's largest file)" if e.errno == errno.EFBIG
                 else "")
        return (f"{e.strerror or 'out of space'}{limit} writing shard {self.name} in {self.folder}: {free}; {need}. "
                f"Free space there (or raise the limit) and run the same command again: it resumes at its last "
                f"commit ({self.done} inputs done)")


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
