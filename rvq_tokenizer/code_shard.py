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

A shard of audio (tools.tokenize) learns its utterances as they come: its lengths, keys and feature frames are
streamed with each window (`root`, the source's, begins its manifest). A shard of a feature store (tools.encode)
knows them from the store: they are written when it finishes. Either way the codes are committed with the inputs
they cover, and the same command run again goes on from the last commit to the bytes of an unbroken run.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from data.codes_parquet import complete_codes_parquet, write_codes_parquet
from data.resumable_shard import ShardWriter
from data.shard_layout import CODES
from models.codes import code_frames, km_lines
from rvq_tokenizer.codes_spec import CodesSpec

log = logging.getLogger(__name__)


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
        and one count of shards a folder); None when it is finished already, its parquet then written if asked for
        and missing. `root`: the source's root, for a shard whose utterances are learnt as they come (their lines
        streamed); None for one whose utterances are known (`finish` is given them). `rows` (the code frames) or
        `inputs` (the utterances), when known, size what a full disk is told to free; `redo`: what --overwrite
        does, in words."""
        streams = ({CODES.lengths: "", CODES.keys: f"{root}\n", CODES.skipped: "", CODES.frames: ""}
                   if root is not None else {CODES.skipped: ""})
        if spec.km:
            streams[CODES.km] = ""
        writer = ShardWriter.begin(folder, name, CODES, settings, overwrite=overwrite, log=log, redo=redo,
                                   width=spec.levels, dtype=spec.dtype, streams=streams, rows=rows, inputs=inputs)
        if writer is None:
            if parquet:  # after the folder's lock: a large shard's parquet takes a while
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
