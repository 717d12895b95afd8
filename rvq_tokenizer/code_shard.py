"""A shard of codes, written as it is computed and resumed after a crash (data/resumable_shard.py ShardWriter): what
tools.encode and tools.tokenize write with a codec, for NAME = {split}_{rank}_{nshard} (data/shard_layout.py CODES):

- `NAME.codes.npy`: [code frames, levels] of the spec's dtype, every utterance's codes in order;
- `NAME.codes.len`: code frames per utterance, one per line;
- `NAME.codes.json`: the settings and counts (the caller's record, with each utterance's feature frames);
- `NAME.codes.tsv`: the utterances' audio files or keys as a fairseq manifest, where they are known;
- `NAME.km` with a .km level: fairseq's label file, that level's codes, a line per utterance;
- `NAME.codes.skipped`: the utterances left out (or given codes of -1), and why, one a line;
- `NAME.codes.parquet` when asked for: a row per utterance (data/codes_parquet.py), once the shard is finished, or
  when a finished shard is found without it.

The .km level is a view of the codes, not a setting that makes them (KM_LEVEL, ShardWriter's `views`): a finished
shard asked for another level has its .km written again from its codes (`complete_km`), one asked for none keeps
the .km it has. A shard in progress finishes with the level it began with.

A shard of audio (tools.tokenize) learns its utterances as they come: its lengths, keys and feature frames are
streamed with each window (`root`, the source's, begins its manifest). A shard of a feature store (tools.encode)
knows them from the store: they are written when it finishes. Either way the codes are committed with the inputs
they cover, and the same command run again goes on from the last commit to the bytes of an unbroken run.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from data.codes_parquet import complete_codes_parquet, utterance_groups, write_codes_parquet
from data.dump_writer import publish, write_temporary
from data.resumable_shard import DISK_FULL, ShardWriter, finished_meta
from data.shard_layout import CODES
from data.writer_lock import WriterLock
from errors import BadInputError, TransientFault
from models.codes import code_frames, km_lines
from rvq_tokenizer.codes_spec import CodesSpec

log = logging.getLogger(__name__)
KM_LEVEL = "km_level"  # the setting of the .km's level (codes_spec.py): a view of the codes, written again from them
KM_BLOCK_FRAMES = 1 << 20  # code frames read at a time when a finished shard's .km is written from its codes


class CodeShard:
    """One shard of codes with one codec's `spec`, from `begin` to `finish`: `write` adds a window of utterances'
    codes (and their lines in every stream), `skip` an utterance's line in NAME.codes.skipped, `commit` makes them
    durable with the inputs they cover; `finish` publishes the shard and, when asked, its parquet view. `done` and
    `rows` are what is committed (the inputs, the code frames)."""

    def __init__(self, writer: ShardWriter, spec: CodesSpec, *, streamed: bool, parquet: bool):
        self.writer, self.spec, self.streamed, self.parquet = writer, spec, streamed, parquet

    @classmethod
    def begin(cls, folder: Path, name: str, spec: CodesSpec, settings: dict, *, overwrite: bool, redo: str,
              parquet: bool = False, root: str | None = None, rows: int | None = None,
              inputs: int | None = None) -> CodeShard | None:
        """Start (or resume) shard NAME in `folder` with `settings` (ShardWriter.begin: the shard's lock, one codec
        and one count of shards a folder); None when it is finished already, its .km then written from its codes
        if another level is asked for (`complete_km`), and its parquet if asked for and missing. `root`: the
        source's root, for a shard whose utterances are learnt as they come (their lines streamed); None for one
        whose utterances are known (`finish` is given them). `rows` (the code frames) or `inputs` (the utterances),
        when known, size what a full disk is told to free; `redo`: what --overwrite does, in words."""
        streams = ({CODES.lengths: "", CODES.keys: f"{root}\n", CODES.skipped: "", CODES.frames: ""}
                   if root is not None else {CODES.skipped: ""})
        if spec.km:
            streams[CODES.km] = ""
        writer = ShardWriter.begin(folder, name, CODES, settings, overwrite=overwrite, log=log, redo=redo,
                                   width=spec.levels, dtype=spec.dtype, streams=streams, rows=rows, inputs=inputs,
                                   views=(KM_LEVEL,))
        if writer is None:  # after the folder's lock: a large shard's .km or parquet takes a while
            complete_km(folder, name, spec.km)
            if parquet:
                complete_codes_parquet(folder, name, CODES)
            return None
        return cls(writer, spec, streamed=root is not None, parquet=parquet)

    @property
    def done(self) -> int:
        return self.writer.done

    @property
    def rows(self) -> int:
        return self.writer.rows

    @property
    def skipped_list(self) -> str:
        """The shard's list of utterances left out, by its file's name."""
        return self.writer.name + CODES.skipped

    def say_resumed(self, noun: str, total: int) -> None:
        """The log's line for a shard that resumes (nothing for one that begins): where, and what was dropped."""
        if self.done:
            log.info("resuming at %s %d of %d (%d code frames committed; %d bytes written after the last commit "
                     "dropped)", noun, self.done, total, self.rows, self.writer.dropped_bytes)

    def write(self, codes: np.ndarray, feature_frames: np.ndarray, keys: Iterable[str] = ()) -> np.ndarray:
        """Append the codes of a window's utterances (`feature_frames` each; `keys`, their manifest lines, for a
        streamed shard) and their lines in every stream, not yet durable; returns their code frames."""
        self.writer.write(codes)
        lengths = code_frames(feature_frames, self.spec.model.config.downsample)
        if self.streamed:
            self.writer.append(CODES.lengths, "".join(f"{n}\n" for n in lengths))
            self.writer.append(CODES.keys, "".join(f"{key}\n" for key in keys))
            self.writer.append(CODES.frames, "".join(f"{n}\n" for n in feature_frames))
        if self.spec.km:
            self.writer.append(CODES.km, km_lines(codes, lengths, self.spec.km))
        return lengths

    def skip(self, line: str) -> None:
        """An utterance's line (`key<TAB>reason`, its newline included) in NAME.codes.skipped."""
        self.writer.append(CODES.skipped, line)

    def skip_file(self, item) -> None:
        """A file of a window skipped (data/audio/pipeline.py AudioFile): its line, and a warning now."""
        self.writer.skip(log, item)

    def commit(self, done: int) -> None:
        self.writer.commit(done)

    def write_windows(self, pipeline, write: Callable[[object, object], None], before_commit: Callable[[int], None],
                      bar, prepare: Callable[[object], object]) -> None:
        """ShardWriter.write_windows: each window prepared on this thread, written and committed on the writer's."""
        self.writer.write_windows(pipeline, write, before_commit, bar, prepare=prepare)

    def finish(self, meta: Callable[[list[int], int], dict], *, files: str = "", feature_frames=None,
               keys: Iterable[str] | None = None) -> tuple[Path, list[int], int] | None:
        """Publish the shard: (its array, each utterance's feature frames, the count skipped), its record
        `meta(feature frames, skipped)` written as NAME.codes.json, then its parquet when asked for. A streamed shard
        takes its utterances from its streams (None, the partial shard discarded and the reason logged, when every
        file was skipped; `files` names them); a shard of known utterances is given their `feature_frames` and the
        `keys` of its manifest (its lines, the root first; None: no manifest)."""
        if self.streamed:
            finished = self.writer.finish_utterances(log, CODES.frames, meta, files=files)
        else:
            frames = [int(n) for n in feature_frames]
            skipped = self.writer.text(CODES.skipped).count("\n")
            lengths = code_frames(np.asarray(frames, dtype=np.int64), self.spec.model.config.downsample)
            texts = {CODES.lengths: (f"{n}\n" for n in lengths), CODES.meta: json.dumps(meta(frames, skipped)) + "\n"}
            if keys is not None:
                texts[CODES.keys] = keys
            finished = self.writer.finish(texts), frames, skipped
        if finished is not None and self.parquet:
            write_codes_parquet(self.writer.folder, self.writer.name, CODES)  # while this writer holds the lock
        return finished

    def wrote(self, utterances: int, array: Path) -> str:
        """The head of the shard's last line: what it holds, where."""
        return (f"wrote {utterances} utterances, {self.rows} code frames ({self.spec.levels} levels, "
                f"{self.spec.bits_per_frame:.0f} bits/frame of features) to {array}")

    def __enter__(self) -> CodeShard:
        return self

    def __exit__(self, *exc) -> None:
        self.writer.close()


def complete_km(folder: Path, name: str, level: int | None) -> Path | None:
    """For a shard found finished: write NAME.km of `level` from its codes when the shard records another level (or
    none) or the file is missing, under the shard's lock; returns its path, or None when nothing was written (the
    level it has, or no level asked for: a .km there is kept). NAME.codes.json names the level the .km holds: it is
    cleared before the file is replaced and set once the new one is in place, so a process killed between the two
    leaves a record that asks for the file again, never one that names a level the file does not hold."""
    meta_path, km = folder / (name + CODES.meta), folder / (name + CODES.km)
    with WriterLock(CODES.lock_path(folder, name), f"shard {folder / (name + CODES.array)}"):
        meta = finished_meta(folder, name, CODES)
        if not meta:  # removed since by --overwrite (or a record this tool did not write: claim_shard refused it)
            return None
        had = meta.get(KM_LEVEL)
        if level is None:
            if had is not None:
                log.info("%s (level %d) is kept as it is: no --km asks for none; nothing to do", km, had)
            return None
        if had == level and km.is_file():
            return None
        log.info("writing %s, level %d, from the finished codes (%s)", km, level,
                 "it was missing" if had == level else f"it held level {had}" if had else "it had none")
        if had is not None:
            _record(meta_path, {**meta, KM_LEVEL: None})
        try:
            publish([], (write_temporary(km, _km_text(folder, name, level)), km))
        except BaseException as e:
            km.with_name(km.name + ".tmp").unlink(missing_ok=True)  # a full disk keeps no half-written file
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise TransientFault(f"{e.strerror} writing {km}: free space in {folder} and run the same command "
                                     "again; the shard's codes are kept") from None
            raise
        _record(meta_path, {**meta, KM_LEVEL: level})
    return km


def _record(path: Path, meta: dict) -> None:
    """Replace NAME.codes.json atomically."""
    publish([], (write_temporary(path, json.dumps(meta) + "\n"), path))


def _km_text(folder: Path, name: str, level: int) -> Iterator[str]:
    """The .km lines of finished shard NAME at `level`, a block of utterances at a time (data/codes_parquet.py
    utterance_groups, as its parquet is written): its codes memory-mapped and its .codes.len read line by line, at
    most KM_BLOCK_FRAMES code frames at once (one utterance longer than that alone)."""
    array, len_path = folder / (name + CODES.array), folder / (name + CODES.lengths)
    codes = np.load(array, mmap_mode="r")
    row = 0
    with open(len_path) as lens:
        counts = (("", int(line)) for line in lens if line.strip())
        for _, lengths in utterance_groups(counts, KM_BLOCK_FRAMES, KM_BLOCK_FRAMES):
            end = row + int(lengths.sum())
            if end > codes.shape[0]:
                raise BadInputError(f"{len_path} lists more code frames than the {codes.shape[0]} rows of {array}")
            yield km_lines(np.asarray(codes[row:end, level - 1 : level]), lengths, 1)
            row = end
    if row != codes.shape[0]:
        raise BadInputError(f"{len_path} lists {row} code frames; {array} has {codes.shape[0]}")
