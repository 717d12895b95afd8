"""Where the audio comes from: the sources tools.extract and tools.tokenize read, and how NSHARD RANK splits one.

SOURCE is one of (`source_kind` tells them apart by the path alone; a path that exists is taken as it is named,
`[2024]` or `{a,b}` in it included, and only one that does not is read as a pattern):
- folder: a folder of .wav/.flac/.ogg files, searched recursively; key: the file's path under it;
- manifest: a fairseq .tsv manifest (data/manifests.py); key: the path its line gives;
- webdataset: WebDataset tar shards: one .tar, a brace pattern as WebDataset expands it
  (`shards/train-{000000..001999}.tar`: each file it names must be there), a glob (what it matches), or a folder
  holding .tar files. An utterance is the members that share a key (webdataset's base_plus_ext: the member's path
  up to the first dot of its name); its audio is its first member of an audio extension (AUDIO_EXTENSIONS), or of
  `audio_ext`; key: the tar key;
- parquet: Hugging Face's parquet layout (a folder of .parquet files, searched recursively, a pattern, or one
  file) or a folder written by `datasets`' save_to_disk (state.json beside .arrow files); the audio is the
  `audio_column` (an Audio column, stored as {bytes, path}); key: the `key_column`, by default the first of
  KEY_COLUMNS the table has, else the row's place (`file:row`);
- lhotse: a Lhotse CutSet (.jsonl or .jsonl.gz); an utterance is a cut, read by lhotse (a cut of a recording is
  that span of it); key: the cut id.

Nothing is unpacked: a member of a tar is read where it lies (its offset, from the tar's headers, read front to
back), a parquet row from its row group, an arrow row from the memory-mapped file, a cut by lhotse from its
recording. The audio then goes the way of a loose file's (data/audio/features.py read_audio, model_input).

NSHARD RANK splits the source into contiguous shares of units, as fairseq's simple_kmeans splits a manifest's
files: the files of a folder or manifest, the cuts of a CutSet, and the tar, parquet or arrow files of a
container source when there are at least NSHARD of them; else the utterances of all the containers (each rank
then lists every container, and the few there are). A rank lists only its own containers' members or rows and
parses only its own cuts, so what it reads before its first file grows with its share, not with the corpus.

What cannot be read is an utterance with a reason, skipped and listed as a file is: a member the tar ends
inside, a tar that ends without its end-of-archive blocks (listed under the tar's name: what followed is
lost), a key with no audio member, a parquet file that cannot be opened (listed under its name: its rows are
lost), a row whose bytes are not audio, a cut beyond its recording's end.
The pyarrow, webdataset and lhotse libraries (requirements-sources.txt) are imported where they are used.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.audio.features import BadAudio, load_audio, model_input, read_audio
from data.dump_writer import shard_range
from data.manifests import AUDIO_SUFFIXES, list_audio_folder, read_manifest
from errors import SOURCES_INSTALL, BadInputError

AUDIO_EXTENSIONS = ("flac", "wav", "mp3", "ogg", "opus")  # a WebDataset sample's audio member, the first found
KEY_COLUMNS = ("id", "key", "__key__", "segment_id", "utt_id", "audio_id", "path", "file")  # Hub audio sets' keys
AUDIO_COLUMN = "audio"  # the Hub's Audio column
MANIFEST_SUFFIXES = (".tsv", ".txt", "")  # a fairseq manifest's names (train.tsv, as wav2vec_manifest.py writes it)
KINDS = ("a folder of audio files", "a fairseq .tsv manifest", "WebDataset .tar shards (a .tar, a brace pattern or "
         "a folder of them)", "Hugging Face .parquet files (or a save_to_disk folder)",
         "a Lhotse CutSet (.jsonl or .jsonl.gz)")


@dataclass(frozen=True)
class SourceFlags:
    """How to read a container source: the audio member's extension (webdataset), the audio and key columns
    (parquet and arrow)."""

    audio_ext: str | None = None
    audio_column: str = AUDIO_COLUMN
    key_column: str | None = None


@dataclass(frozen=True)
class Unreadable:
    """An entry known to be unreadable from the listing alone."""

    reason: str


@dataclass
class Utterances:
    """A share of a source: utterance i is named keys[i] and read by reader.read(entries[i]) (in a worker process).
    `root`: what the keys are relative to (an output .tsv's first line); units start..end-1 of the source's `total`
    are this share's."""

    kind: str
    root: str
    keys: list[str]
    entries: list
    reader: object
    unit: str = "file"
    start: int = 0
    end: int = 0
    total: int = 0
    listing: str = ""  # the `total` units' names (`listing`; '' when only counted): every rank of a split sees them

    @property
    def source_listing(self) -> dict:
        """The whole source this share was cut from, for a shard's settings: the shards of a split fit together
        only when cut from one (data/resumable_shard.py check_split_shards)."""
        return {"units": self.total, "unit": self.unit, "listing": self.listing}

    @classmethod
    def files(cls, root: Path, relpaths: list[str]) -> Utterances:
        """Files `relpaths` under `root`."""
        return cls("folder", str(root), list(relpaths), list(relpaths), FileReader(root), "file", 0, len(relpaths),
                   len(relpaths), listing(relpaths))

    @classmethod
    def listed(cls, keys: list[str], entries: list, reader) -> Utterances:
        """Utterances named `keys`, utterance i read by reader.read(entries[i]): a caller's own list (rvq_tokenizer's
        files by path, or waves in memory, WavesInMemory)."""
        return cls("listed", "", list(keys), list(entries), reader, "utterance", 0, len(keys), len(keys))

    @property
    def noun(self) -> str:
        """What one utterance is, in the log: a file, for a folder or manifest."""
        return "file" if self.kind in ("folder", "manifest") else "utterance"

    def groups(self, first: int) -> list[tuple[int, int]]:
        """Utterances first.. as runs read together (reader.read_group): a parquet row group's rows, else one."""
        group = getattr(self.reader, "group", None)
        if group is None:
            return [(i, i + 1) for i in range(first, len(self.entries))]
        runs, begin = [], first
        for i in range(first + 1, len(self.entries) + 1):
            if i == len(self.entries) or group(self.entries[i]) != group(self.entries[begin]):
                runs.append((begin, i))
                begin = i
        return runs


def read_group(reader, entries: list) -> list[np.ndarray | BadAudio]:
    """Each entry's wave, or the BadAudio that says why it cannot be read."""
    if hasattr(reader, "read_group"):
        return reader.read_group(entries)
    waves = []
    for entry in entries:
        try:
            waves.append(reader.read(entry))
        except BadAudio as e:
            waves.append(e)
    return waves


def _unreadable(entry) -> None:
    if isinstance(entry, Unreadable):
        raise BadAudio(entry.reason)


class FileReader:
    """A folder's (or a manifest's) files: entry = the path under the root."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def read(self, rel: str) -> np.ndarray:
        return load_audio(self.root / rel)


class WavesInMemory:
    """Waves already in memory, as data/audio/features.py model_input makes them (mono float32 at 16 kHz): an entry
    is its wave."""

    @staticmethod
    def read(wave: np.ndarray) -> np.ndarray:
        return wave


# ---- the kind of a source -------------------------------------------------------------------------------------

def expand(source: str) -> list[str]:
    """The files a brace pattern (WebDataset's notation, braceexpand) or a glob names, sorted when it globs. A brace
    pattern names each file, so one not there (a mistyped range, a failed download) is a BadInputError naming it,
    never dropped; a glob takes what there is ([] when nothing is)."""
    names = [source]
    if "{" in source:
        names = list(_need("braceexpand", "a brace pattern").braceexpand(source))  # webdataset's own dependency
    found = {name: _files(name) for name in names}
    missing = [name for name, files in found.items() if not files]
    if missing and len(missing) < len(found):
        shown = ", ".join(missing[:5]) + (f" ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise BadInputError(f"{source}: {len(missing)} of the {len(found)} files it names are not there ({shown}); a "
                            "brace pattern names each file: correct the range, or fetch the missing files")
    files = [f for listed in found.values() for f in listed]
    return sorted(set(files)) if _globs(source) else files


def _files(name: str) -> list[str]:
    """The files one name of a pattern stands for: itself when it is a file (its name taken literally), else what
    its glob matches."""
    if Path(name).is_file():
        return [name]
    return [p for p in glob.glob(name, recursive=True) if Path(p).is_file()] if _globs(name) else []


def _globs(text: str) -> bool:
    return any(c in text for c in "*?[")


def source_kind(source: Path) -> tuple[str, list[Path]]:
    """(kind, the container files: tars, parquet or arrow files, else []) of SOURCE; BadInputError naming the
    kinds accepted when it is none of them. A SOURCE that exists is taken as it is named (a folder may be called
    `Recordings [2024]`); only one that does not is read as a pattern (expand)."""
    text = str(source)
    accepted = "give " + "; ".join(KINDS)
    if not source.exists():
        if "{" not in text and not _globs(text):
            raise BadInputError(f"{source} does not exist: {accepted}")
        paths = [Path(n) for n in expand(text)]
        if not paths:
            raise BadInputError(f"{source} names no file: {accepted}")
        return _containers(source, paths, accepted)
    if source.is_dir():
        if (source / "state.json").is_file() and any(source.glob("*.arrow")):
            return "arrow", _saved_dataset_files(source)
        if not any(p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES for p in source.rglob("*")):
            tars = sorted(p for p in source.rglob("*.tar") if p.is_file())
            parquet = sorted(p for p in source.rglob("*.parquet") if p.is_file())
            if tars or parquet:
                return _containers(source, tars or parquet, accepted)
        return "folder", []
    name = source.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "lhotse", []
    if name.endswith((".tar", ".parquet")):
        return _containers(source, [source], accepted)
    if name.endswith((".tar.gz", ".tgz")):
        raise BadInputError(f"{source} is a compressed tar, whose members cannot be read where they lie: WebDataset "
                            "shards are plain .tar files (their members compressed, as .flac or .opus are)")
    if source.suffix.lower() in MANIFEST_SUFFIXES:
        return "manifest", []
    raise BadInputError(f"{source} is none of the sources read here: {accepted}")


def _containers(source: Path, paths: list[Path], accepted: str) -> tuple[str, list[Path]]:
    kinds = {".tar": "webdataset", ".parquet": "parquet"}
    found = {kinds.get(p.suffix.lower()) for p in paths}
    if len(found) != 1 or None in found:
        raise BadInputError(f"{source} holds {', '.join(sorted({p.suffix or p.name for p in paths}))} files, not "
                            f"one kind of container: {accepted}")
    return found.pop(), paths


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The arrow files of a `datasets` save_to_disk folder, in its state.json's order."""
    try:
        state = json.loads((folder / "state.json").read_text())
        return [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInputError(f"{folder}/state.json is not a save_to_disk state ({e})") from None


def _need(module: str, kind: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:  # not installed, or installed without what it imports (lhotse 1.33: urllib3)
        raise BadInputError(f"reading {kind} needs {module.split('.')[0]}, which cannot be imported ({e}): "
                            f"{SOURCES_INSTALL}") from None


# ---- a share of a source ---------------------------------------------------------------------------------------

def source_share(source: Path, nshard: int, rank: int, flags: SourceFlags = SourceFlags()) -> Utterances:
    """Share `rank` of `nshard` of SOURCE (module doc); BadInputError for a source of no known kind, one that
    lists nothing, or an empty share."""
    kind, containers = source_kind(source)
    if kind in ("folder", "manifest"):
        root, relpaths = (source.resolve(), list_audio_folder(source)) if kind == "folder" else read_manifest(source)
        start, end = _share(len(relpaths), nshard, rank, source, "file")
        return Utterances(kind, str(root), relpaths[start:end], relpaths[start:end], FileReader(root), "file",
                          start, end, len(relpaths), listing(relpaths))
    if kind == "lhotse":
        return _lhotse_share(source, nshard, rank)
    lister = {"webdataset": _tar_utterances, "parquet": _parquet_utterances, "arrow": _arrow_utterances}[kind]
    root = str(Path(source).absolute())
    unit = {"webdataset": "tar file", "parquet": "parquet file", "arrow": "arrow file"}[kind]
    reader = {"webdataset": TarReader, "parquet": ParquetReader, "arrow": ArrowReader}[kind](
        [str(p) for p in containers], flags)
    if len(containers) >= nshard:
        start, end = _share(len(containers), nshard, rank, source, unit)
        keys, entries = [], []
        for c in range(start, end):
            for key, entry in lister(containers, c, flags):
                keys.append(key)
                entries.append(entry)
        return Utterances(kind, root, keys, entries, reader, unit, start, end, len(containers),
                          listing(Path(c).name for c in containers))
    listed = [item for c in range(len(containers)) for item in lister(containers, c, flags)]
    start, end = _share(len(listed), nshard, rank, source, "utterance")
    return Utterances(kind, root, [k for k, _ in listed[start:end]], [e for _, e in listed[start:end]], reader,
                      "utterance", start, end, len(listed), listing(k for k, _ in listed))


def listing(names) -> str:
    """A digest of names in their order, one a line (a source's units: files by their paths under the root,
    containers by their file names, utterances by their keys; or a share's keys): two machines that list one
    source alike get the same."""
    digest = hashlib.sha256()
    for n, name in enumerate(names):
        digest.update((b"\n" if n else b"") + name.encode("utf-8", "surrogateescape"))
    return f"sha256:{digest.hexdigest()[:16]}"


def _share(total: int, nshard: int, rank: int, source: Path, unit: str) -> tuple[int, int]:
    start, end = shard_range(total, nshard, rank)
    if start == end:
        raise BadInputError(f"shard {rank} of {nshard} is empty: {source} holds only {total} {unit}(s); use fewer "
                            "shards")
    return start, end


# ---- WebDataset tar shards ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TarMember:
    """An utterance's audio in tar file `tar` (the source's index): `size` bytes at `offset`."""

    tar: int
    name: str
    offset: int
    size: int


def _tar_utterances(tars: list[Path], c: int, flags: SourceFlags) -> Iterator[tuple[str, TarMember | Unreadable]]:
    """(key, its audio member or why there is none) of each sample of tar `c`, in the tar's order: its headers
    read front to back, the members' data passed over."""
    base_plus_ext = _need("webdataset.tariterators", "WebDataset shards").base_plus_ext
    path = tars[c]
    size = path.stat().st_size
    wanted = (flags.audio_ext.lower().lstrip("."),) if flags.audio_ext else AUDIO_EXTENSIONS
    no_audio = Unreadable("no audio member (" + ", ".join("." + e for e in wanted) + ")")
    try:
        archive = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as e:
        yield path.name, Unreadable(f"not a readable tar: {e}")
        return
    key, audio, last, broken = None, None, None, None
    with archive:
        while True:
            try:
                member = archive.next()
            except (tarfile.TarError, OSError) as e:
                broken = f"a header after {last or 'its start'} cannot be read ({e}): what follows it is lost"
                break
            if member is None:
                break
            base, ext = base_plus_ext(member.name)
            if not member.isfile() or base is None:  # webdataset passes over a name with no extension too
                continue
            if base != key:
                if key is not None:
                    yield key, audio or no_audio
                key, audio = base, None
            last, ext = member.name, ext.lower()
            if audio is None and (ext == wanted[0] if flags.audio_ext else ext.rsplit(".", 1)[-1] in wanted):
                audio = TarMember(c, member.name, member.offset_data, member.size)
                if member.offset_data + member.size > size:
                    audio = Unreadable(f"truncated: the tar ends inside {member.name} "
                                       f"({size - member.offset_data} of its {member.size} bytes there)")
        ended = archive.offset  # after the last member's data: the end-of-archive blocks follow in a whole tar
    if key is not None:
        yield key, audio or no_audio
    if broken or size < ended + 2 * tarfile.BLOCKSIZE:
        yield path.name, Unreadable(broken or f"truncated tar: it ends at byte {size} without the end-of-archive "
                                              f"blocks; whatever followed {last or 'its start'} is lost")


class TarReader:
    """Members of WebDataset tar files, each read at its offset (os.pread: no file position shared with the
    process a worker was forked from)."""

    def __init__(self, tars: list[str], flags: SourceFlags):
        self.tars = tars
        self._files: dict[int, int] = {}
        self._pid = os.getpid()

    def read(self, entry: TarMember | Unreadable) -> np.ndarray:
        _unreadable(entry)
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        if entry.tar not in self._files:
            if len(self._files) > 8:
                for fd in self._files.values():
                    os.close(fd)
                self._files.clear()
            self._files[entry.tar] = os.open(self.tars[entry.tar], os.O_RDONLY)
        data = os.pread(self._files[entry.tar], entry.size, entry.offset)
        if len(data) < entry.size:
            raise BadAudio(f"truncated: the tar ends inside {entry.name}")
        return read_audio(io.BytesIO(data), Path(entry.name).suffix)

    def __getstate__(self):
        return {"tars": self.tars, "_files": {}, "_pid": None}


# ---- Hugging Face parquet and save_to_disk -------------------------------------------------------------------------

@dataclass(frozen=True)
class TableRow:
    """Row `row` of the source's table file `file` (in row group `group` of a parquet file; 0 for arrow)."""

    file: int
    group: int
    row: int


def _columns(schema, path: Path, flags: SourceFlags) -> tuple[str, str | None]:
    """(the audio column, the key column or None) of a table with `schema`, checked."""
    names = list(schema.names)
    if flags.audio_column not in names:
        raise BadInputError(f"{path} has no column {flags.audio_column!r} (its columns: {', '.join(names)}): name "
                            "the audio column with --audio_column")
    if flags.key_column is not None and flags.key_column not in names:
        raise BadInputError(f"{path} has no column {flags.key_column!r} (its columns: {', '.join(names)}): name "
                            "the key column with --key_column")
    key = flags.key_column or next((k for k in KEY_COLUMNS if k in names and k != flags.audio_column), None)
    return flags.audio_column, key


def _parquet_utterances(files: list[Path], c: int,
                        flags: SourceFlags) -> Iterator[tuple[str, TableRow | Unreadable]]:
    """(key, its row or why it cannot be read) of each row of parquet file `c`: a file that cannot be opened (cut
    short, or not parquet) is one unreadable entry under its name, a row group whose keys cannot be read one
    under `NAME:row group G`, as a truncated tar is listed (what they hold is lost)."""
    pq = _need("pyarrow.parquet", "parquet")
    path = files[c]
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any file that cannot be opened is skipped and named
        yield path.name, Unreadable(f"not a readable parquet file ({e}): its rows are lost")
        return
    _, key = _columns(table.schema_arrow, path, flags)
    base = 0
    for g in range(table.num_row_groups):
        rows = table.metadata.row_group(g).num_rows
        try:
            keys = (table.read_row_group(g, columns=[key]).column(0).to_pylist() if key else
                    [f"{path.name}:{base + i}" for i in range(rows)])
        except Exception as e:  # noqa: BLE001 - a damaged row group is skipped and named
            yield f"{path.name}:row group {g}", Unreadable(f"its {rows} row(s) cannot be read ({e}): they are lost")
            keys = []
        for i, k in enumerate(keys):
            yield str(k), TableRow(c, g, i)
        base += rows


class ParquetReader:
    """Rows of parquet files, a row group's audio read once for all its rows (`group`)."""

    def __init__(self, files: list[str], flags: SourceFlags):
        self.files, self.column = files, flags.audio_column

    @staticmethod
    def group(entry: TableRow | Unreadable) -> tuple[int, int] | Unreadable:
        return entry if isinstance(entry, Unreadable) else (entry.file, entry.group)

    def read_group(self, entries: list[TableRow | Unreadable]) -> list[np.ndarray | BadAudio]:
        import pyarrow.parquet as pq

        first = entries[0]
        if isinstance(first, Unreadable):
            return [BadAudio(entry.reason) for entry in entries]
        try:
            column = pq.ParquetFile(self.files[first.file]).read_row_group(first.group, columns=[self.column])
            cells = column.column(0)
        except Exception as e:  # noqa: BLE001 - the group's rows are skipped, named with the reason
            return [BadAudio(f"unreadable row group {first.group} of {self.files[first.file]}: {e}")] * len(entries)
        return [_cell_audio(cells[e.row].as_py()) for e in entries]


def _cell_audio(cell) -> np.ndarray | BadAudio:
    """An Audio cell ({bytes, path}) -> its wave, or why not."""
    try:
        if not isinstance(cell, dict) or not cell.get("bytes"):
            raise BadAudio("no audio bytes in the row (an Audio cell of {bytes, path} whose bytes are empty)")
        return read_audio(io.BytesIO(cell["bytes"]), Path(cell.get("path") or "").suffix)
    except BadAudio as e:
        return e


def _arrow_table(path: str):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()


def _arrow_utterances(files: list[Path], c: int, flags: SourceFlags) -> Iterator[tuple[str, TableRow]]:
    _need("pyarrow", "a save_to_disk dataset")
    path = files[c]
    try:
        table = _arrow_table(str(path))
    except Exception as e:  # noqa: BLE001 - named
        raise BadInputError(f"{path} is not a readable arrow file of a save_to_disk dataset: {e}") from None
    _, key = _columns(table.schema, path, flags)
    keys = table.column(key).to_pylist() if key else [f"{path.name}:{i}" for i in range(table.num_rows)]
    for i, k in enumerate(keys):
        yield str(k), TableRow(c, 0, i)


class ArrowReader:
    """Rows of a save_to_disk dataset's arrow files, memory-mapped (zero copy) once in each process."""

    def __init__(self, files: list[str], flags: SourceFlags):
        self.files, self.column = files, flags.audio_column
        self._tables: dict = {}
        self._pid = os.getpid()

    def read(self, entry: TableRow) -> np.ndarray:
        if self._pid != os.getpid():
            self._tables, self._pid = {}, os.getpid()
        if entry.file not in self._tables:
            self._tables = {entry.file: _arrow_table(self.files[entry.file])}
        got = _cell_audio(self._tables[entry.file].column(self.column)[entry.row].as_py())
        if isinstance(got, BadAudio):
            raise got
        return got

    def __getstate__(self):
        return {"files": self.files, "column": self.column, "_tables": {}, "_pid": None}


# ---- Lhotse CutSets --------------------------------------------------------------------------------------------------

def _cut_lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield line
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path} cannot be read as a CutSet ({e})") from None


def _lhotse_share(source: Path, nshard: int, rank: int) -> Utterances:
    """This rank's cuts: the lines counted, and only the share's parsed."""
    _need("lhotse", "a Lhotse CutSet")
    total = sum(1 for _ in _cut_lines(source))
    start, end = _share(total, nshard, rank, source, "cut")
    keys, cuts = [], []
    for n, line in enumerate(_cut_lines(source)):
        if n >= end:
            break
        if n >= start:
            try:
                cut = json.loads(line)
                keys.append(str(cut["id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise BadInputError(f"{source}, line {n + 1}: not a cut ({e})") from None
            cuts.append(cut)
    # the cuts are counted, not listed: a cut's line names its audio's path, which one machine's copy of a CutSet
    # may give otherwise than another's; parsing every line for its id alone would cost more than the count
    return Utterances("lhotse", str(source.absolute()), keys, cuts, CutReader(), "cut", start, end, total)


class CutReader:
    """Cuts as lhotse reads them (its deserialisation and audio loading: a span of a recording for a cut of one)."""

    @staticmethod
    def read(cut: dict) -> np.ndarray:
        from lhotse.serialization import deserialize_item

        try:
            loaded = deserialize_item(cut)
            samples, rate = loaded.load_audio(), loaded.sampling_rate
        except Exception as e:  # noqa: BLE001 - lhotse's errors (a cut past its recording's end ...) are the reason
            raise BadAudio(f"unreadable: {str(e).splitlines()[0]}") from None
        samples = np.asarray(samples, dtype=np.float32)  # [channels, samples]
        return model_input(samples.T if samples.ndim > 1 else samples[:, None], int(rate))

