"""Feature stores on disk: fairseq dumps and directories of per-utterance arrays.

A store is a list of utterances, each a ``[T, D]`` array, read lazily
(``np.load(mmap_mode="r")``). ``open_split`` finds and validates one split;
every problem a user can fix raises ``BadInputError`` naming the file.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.manifests import AUDIO_SUFFIXES
from data.resumable_shard import other_source, shard_settings
from data.shard_layout import FEATURE_DUMP
from errors import BadInputError

log = logging.getLogger(__name__)

UTTERANCE_SUFFIXES = (".npy", ".pt")


@dataclass
class FeatureStore:
    """Utterances of one split: utterance i is `lengths[i]` rows of `dim` features, from row `first[i]` of
    source `shard[i]`. Per-utterance metadata are numpy arrays (about 30 bytes an utterance); a name is
    made only for a message."""

    description: str
    lengths: np.ndarray  # int64 frames per utterance
    dim: int
    sources: list = field(repr=False)  # fairseq: memmapped [frames, dim] arrays; directory: file paths
    shard: np.ndarray = field(repr=False)  # int32: which source
    first: np.ndarray = field(repr=False)  # int64: first row in that source
    number: np.ndarray = field(repr=False)  # int64: the utterance's position in its source's .len file

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_frames(self) -> int:
        return int(self.lengths.sum())

    @property
    def dtype(self) -> np.dtype:
        """float16 when every source is a float16 array (a half-precision dump), else float32 (what reads give)."""
        arrays = self.sources and all(isinstance(s, np.ndarray) and s.dtype == np.float16 for s in self.sources)
        return np.dtype(np.float16 if arrays else np.float32)

    def name(self, i: int) -> str:
        """The utterance for a message: its file, or its shard file, line in the .len and rows."""
        source = self.sources[int(self.shard[i])]
        if isinstance(source, Path):
            return str(source)
        row, number = int(self.first[i]), int(self.number[i])
        audio = audio_file(Path(source.filename), number)
        return (f"{Path(source.filename).name} utterance {number} (rows {row}-{row + int(self.lengths[i])}"
                + (f", audio {audio})" if audio else ")"))

    def utterance(self, i: int) -> np.ndarray:
        """The `[T, D]` array of utterance i (a memory-mapped view where possible)."""
        source = self.sources[int(self.shard[i])]
        if isinstance(source, Path):
            array = _load_array(source)
            if array.ndim != 2 or array.shape != (int(self.lengths[i]), self.dim):
                raise BadInputError(
                    f"{source} has shape {tuple(array.shape)}, its folder's {MANIFEST_NAME} says "
                    f"({int(self.lengths[i])}, {self.dim}): the file was written again since; delete "
                    f"{source.parent / MANIFEST_NAME} (the next start reads every file's shape again) and rerun")
            return array
        row = int(self.first[i])
        return source[row : row + int(self.lengths[i])]

    @contextlib.contextmanager
    def scattered_reads(self):
        """No kernel readahead on the dump while a sample is read from utterances spread over it: each page
        fault reading ahead megabytes made 256 utterances of a 10^6-utterance dump take 5 s instead of 5 ms.
        Training crops keep the readahead (a crop is a run of pages)."""
        maps = [s._mmap for s in self.sources if getattr(s, "_mmap", None) is not None]
        advise = hasattr(mmap, "MADV_RANDOM")
        for m in maps if advise else []:
            m.madvise(mmap.MADV_RANDOM)
        try:
            yield self
        finally:
            for m in maps if advise else []:
                m.madvise(mmap.MADV_NORMAL)

    def subset(self, indices, description: str) -> "FeatureStore":
        """These utterances, in this order: array indexing, no per-utterance Python work."""
        indices = np.asarray(indices, dtype=np.int64)
        return FeatureStore(description, self.lengths[indices], self.dim, self.sources, self.shard[indices],
                            self.first[indices], self.number[indices])

    def share(self, start: int, end: int) -> "FeatureStore":
        """Utterances start..end-1, holding only the sources they read from: a process that works on one share
        of a split keeps no other shard's map or file list."""
        used = np.unique(self.shard[start:end])
        return FeatureStore(f"{self.description}, utterances {start}-{end - 1}", self.lengths[start:end], self.dim,
                            [self.sources[int(s)] for s in used],
                            np.searchsorted(used, self.shard[start:end]).astype(np.int32),
                            self.first[start:end], self.number[start:end])


IDENTITY_NAMES = 16  # a store of up to this many files is identified by their names, a larger one by a digest


def store_identity(store: FeatureStore, split: str, utterances: int, frames: int) -> dict:
    """What tells one store from another, from metadata alone (start-up must not grow with the corpus): the split,
    its files' names (not their folder: a copy elsewhere is the same store), its utterances and frames (the
    split's, `utterances` and `frames`, held-out ones included)."""
    names = [Path(s.filename).name if isinstance(s, np.ndarray) else Path(s).name for s in store.sources]
    digest = hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]
    files = names if len(names) <= IDENTITY_NAMES else f"{len(names)} files, sha1 {digest}"
    return {"split": split, "files": files, "utterances": int(utterances), "frames": int(frames)}


@functools.lru_cache(maxsize=8)
def _manifest_lines(tsv: Path) -> tuple[str, ...] | None:
    """The lines of the fairseq manifest tools.extract wrote beside a shard (root, then one per utterance), read
    once per shard and only for a message; None when there is none or it cannot be read."""
    try:
        return tuple(tsv.read_text(errors="replace").splitlines())
    except OSError:
        return None


def audio_file(shard: Path, number: int) -> str | None:
    """The audio file utterance `number` of a dump shard was extracted from, when the shard's .tsv is there."""
    lines = _manifest_lines(shard.with_name(shard.name[: -len(FEATURE_DUMP.array)] + FEATURE_DUMP.keys))
    if not lines or number + 1 >= len(lines):
        return None
    return str(Path(lines[0].strip()) / lines[number + 1].split("\t")[0])


def _load_array(path: Path) -> np.ndarray:
    """An utterance's [T, D] array: a .pt tensor, or else a numpy array (UTTERANCE_SUFFIXES)."""
    if path.suffix != ".pt":
        return np.load(path, mmap_mode="r")
    import torch

    try:  # memory-mapped: a crop reads its own pages, not the whole file
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be mapped: read whole
        value = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(value, torch.Tensor):
        raise BadInputError(f"{path}: expected a tensor of shape [T, D], found {type(value).__name__}")
    return value.numpy() if value.dtype == torch.float32 else value.float().numpy()


def _fairseq_shards(folder: Path, split: str) -> list[Path]:
    pattern = re.compile(rf"^{re.escape(split)}_(\d+)_(\d+){re.escape(FEATURE_DUMP.array)}$")
    found = {}
    for path in folder.iterdir():
        m = pattern.match(path.name)
        if m:
            found[(int(m.group(1)), int(m.group(2)))] = path
    if not found:
        return []
    nshards = {n for _, n in found}
    if len(nshards) != 1:
        raise BadInputError(f"{folder}: split '{split}' mixes shard counts {sorted(nshards)}")
    (nshard,) = nshards
    missing = [s for s in range(nshard) if (s, nshard) not in found]
    if missing:
        names = ", ".join(f"{split}_{s}_{nshard}{FEATURE_DUMP.array}" for s in missing)
        raise BadInputError(f"{folder}: split '{split}' is missing shard(s) {names}")
    paths = [found[(s, nshard)] for s in range(nshard)]
    _check_one_source(folder, split, paths)
    return paths


def _check_one_source(folder: Path, split: str, paths: list[Path]) -> None:
    """The shards of a split by tools.extract fit together only when each was cut from the same listing of the
    audio (data/resumable_shard.py check_split_shards, which refuses a shard cut otherwise when one beside it is
    there already; two begun at one instant are caught here)."""
    first = None
    for path in paths:
        listing = (shard_settings(folder, path.stem, FEATURE_DUMP) or {}).get("source_listing")
        if not listing:
            continue
        if first is None:
            first = (path, listing)
        elif differs := other_source(first[1], listing):
            raise BadInputError(f"{folder}: split '{split}' was written from two listings of its audio ({first[0].name}"
                                f" and {path.name}: {differs}), so some utterances are in no shard and others in two; "
                                "extract the split again once its source is complete")


def _open_fairseq(folder: Path, split: str, shard_paths: list[Path]) -> FeatureStore:
    shards, counts_per_shard, dims = [], [], {}
    for npy in shard_paths:
        len_path = npy.with_name(npy.name[: -len(FEATURE_DUMP.array)] + FEATURE_DUMP.lengths)
        if not len_path.exists():
            raise BadInputError(f"{npy} has no {len_path.name} beside it (one frame count per line)")
        counts = _read_len(len_path)
        try:
            array = np.load(npy, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise BadInputError(f"{npy} is not a readable .npy array: {e}") from None
        if array.ndim != 2:
            raise BadInputError(f"{npy} has shape {array.shape}; a fairseq dump is 2-D [frames, dim]")
        if int(counts.sum()) != array.shape[0]:
            raise BadInputError(
                f"{len_path.name} lists {int(counts.sum())} frames in total but {npy.name} has {array.shape[0]} rows; "
                "the .len file must give one frame count per utterance, in order"
            )
        dims[npy.name] = array.shape[1]
        shards.append(array)
        counts_per_shard.append(counts)
    dim = _one_dim(dims)
    lengths = np.concatenate(counts_per_shard) if counts_per_shard else np.zeros(0, np.int64)
    shard = np.repeat(np.arange(len(shards), dtype=np.int32), [len(c) for c in counts_per_shard])
    first = np.concatenate([np.cumsum(c) - c for c in counts_per_shard]) if counts_per_shard else lengths
    number = np.concatenate([np.arange(len(c), dtype=np.int64) for c in counts_per_shard]) if counts_per_shard \
        else lengths
    warn_mixed_precision(split, shard_paths)
    desc = f"fairseq dump '{split}' in {folder} ({len(shard_paths)} shard(s))"
    return FeatureStore(desc, lengths, dim, shards, shard, first, number)


def warn_mixed_precision(split: str, shard_paths: list[Path]) -> dict[str, list[str]]:
    """Warns when a split's shards were extracted at different precisions (bf16 and fp32 features differ
    slightly: a model trained on one and evaluated on the other sees a shift). Reads the tools.extract
    .json beside each shard where there is one; returns {precision: [shard names]}."""
    by_precision: dict[str, list[str]] = {}
    for npy in shard_paths:
        meta = npy.with_name(npy.name[: -len(FEATURE_DUMP.array)] + FEATURE_DUMP.meta)
        try:
            precision = json.loads(meta.read_text()).get("precision")
        except (OSError, ValueError, AttributeError):
            continue  # no record (a dump from another tool): nothing to compare
        if precision is not None:
            by_precision.setdefault(str(precision), []).append(npy.name)
    if len(by_precision) > 1:
        log.warning("split '%s' mixes features extracted at different precisions: %s; re-extract the odd shards "
                    "with the same --precision", split,
                    "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(by_precision.items())))
    return by_precision


def _read_len(path: Path) -> np.ndarray:
    """A .len file's frame counts as int64, parsed by numpy (no Python object per line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an empty file: no utterance
        try:
            counts = np.loadtxt(path, dtype=np.int64, ndmin=1)
        except ValueError:
            raise BadInputError(f"{path}: every line must be a whole number of frames") from None
    if counts.ndim != 1 or (counts < 0).any():
        raise BadInputError(f"{path}: every line must be one whole, non-negative number of frames")
    return counts


MANIFEST_NAME = ".lengths.npz"  # a folder store's frame counts and dim, written once, read at every later start


def _open_directory(folder: Path, label: str, pending: list | None = None,
                    manifest_dir: Path | None = None) -> FeatureStore:
    """A folder of utterance files. Their lengths come from a manifest (in the folder, or for a read-only
    folder in `manifest_dir`) that lists exactly these file names; else every file is opened once and the
    manifest written in the folder, or when it is not writable appended to `pending` as (path, lengths, dim,
    digest) for the caller to save in `manifest_dir` once the data have passed every check."""
    files = sorted(p for p in folder.iterdir() if p.suffix in UTTERANCE_SUFFIXES and p.is_file())
    digest = hashlib.sha1("\n".join(p.name for p in files).encode()).hexdigest()
    elsewhere = manifest_path(folder, manifest_dir) if manifest_dir is not None else None
    found = _read_manifest(folder / MANIFEST_NAME, digest)
    if found is None and elsewhere is not None:
        found = _read_manifest(elsewhere, digest)
    if found is None:
        lengths, dim = _scan_files(files)
        if os.access(folder, os.W_OK):
            save_manifest(folder / MANIFEST_NAME, lengths, dim, digest)
        elif pending is not None and elsewhere is not None:
            pending.append((elsewhere, lengths, dim, digest))
    else:
        lengths, dim = found
    n = len(files)
    return FeatureStore(f"directory of utterances '{label}' in {folder}", lengths, dim,
                        files, np.arange(n, dtype=np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64))


def _scan_files(files: list[Path]) -> tuple[np.ndarray, int]:
    lengths, dims = [], {}
    for path in tqdm(files, desc="reading utterance shapes (once: then the lengths manifest)", unit="file",
                     disable=len(files) < 10000, mininterval=1.0):
        try:
            array = _load_array(path)
        except BadInputError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
            raise BadInputError(f"{path} could not be read: {e}") from None
        if array.ndim != 2:
            raise BadInputError(f"{path} has shape {tuple(array.shape)}; each utterance must be [T, D]")
        lengths.append(array.shape[0])
        dims[path.name] = array.shape[1]
    return np.asarray(lengths, dtype=np.int64), _one_dim(dims)


# the name of a read-only folder's manifest in another directory, and of the temporary it is written through
MANIFEST_ELSEWHERE = re.compile(r"lengths_[0-9a-f]{16}\.npz(\..*\.tmp\.npz)?")


def manifest_path(folder: Path, elsewhere: Path) -> Path:
    """Where a read-only folder's manifest goes in another directory (one name per folder: MANIFEST_ELSEWHERE)."""
    return elsewhere / f"lengths_{hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]}.npz"


def _read_manifest(path: Path, digest: str) -> tuple[np.ndarray, int] | None:
    """(lengths, dim) from a manifest that lists exactly the files named by `digest`, else None."""
    try:
        with np.load(path) as saved:
            if str(saved["digest"]) != digest:
                return None  # files were added, removed or renamed: read them again
            return saved["lengths"].astype(np.int64), int(saved["dim"])
    except (OSError, KeyError, ValueError):
        return None


def save_manifest(path: Path, lengths: np.ndarray, dim: int, digest: str) -> None:
    """Written under a temporary name and renamed: a reader never sees half a manifest."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp.npz")  # ranks may write at once
    try:
        np.savez(tmp, lengths=lengths, dim=dim, digest=digest)
        os.replace(tmp, path)
    except OSError as e:  # a manifest only saves time: the next start reads the files again
        log.warning("could not write the lengths manifest %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def _one_dim(dims: dict) -> int:
    values = sorted(set(dims.values()))
    if len(values) > 1:
        examples = {}
        for name, d in dims.items():
            examples.setdefault(d, name)
        detail = ", ".join(f"{name} has {d}" for d, name in sorted(examples.items()))
        raise BadInputError(f"feature dims differ within the store: {detail}; every utterance needs the same dim")
    return values[0] if values else 0


TRAIN_SPLIT, VALID_SPLIT = "train", "valid"  # the defaults of --train_split and --valid_split
_DUMP_LEN = re.compile(rf"^(.+)_(\d+)_(\d+){re.escape(FEATURE_DUMP.lengths)}$")


def dump_splits(folder: Path) -> list[str]:
    """The splits of a fairseq dump in `folder`: names with a `{split}_{shard}_{nshard}.npy` and its `.len`
    beside it (the .len tells a dump's shard from an utterance file that happens to be named like one)."""
    names = set(os.listdir(folder))
    return sorted({m.group(1) for name in names if (m := _DUMP_LEN.match(name)) and name[: -len(FEATURE_DUMP.lengths)] + FEATURE_DUMP.array in names})


def split_names(folder: Path) -> list[str]:
    """Every split in `folder`: a fairseq dump's, and sub-folders that hold utterance files."""
    subs = {p.name for p in folder.iterdir()
            if p.is_dir() and any(f.suffix in UTTERANCE_SUFFIXES for f in p.iterdir())}
    return sorted(set(dump_splits(folder)) | subs)


def missing_split(data_dir: Path, split: str, flag: str) -> BadInputError:
    """The error for a split that `data_dir` does not hold, naming the splits it does."""
    found = split_names(data_dir)
    if found:
        return BadInputError(f"no split '{split}' in {data_dir}, which holds the split(s) "
                             f"{', '.join(repr(s) for s in found)}: give one of them to {flag}")
    return BadInputError(f"no split '{split}' in {data_dir}: expected a fairseq dump ({split}_0_1.npy with "
                         f"{split}_0_1.len) or a folder {split}/ of .npy/.pt arrays [T, D]")


def find_split(data_dir: Path, split: str, loose_files: bool | None = None, pending: list | None = None,
               manifest_dir: Path | None = None) -> FeatureStore | None:
    """The store of `split` in `data_dir`, or None when the split is not there.

    Looked for in order: a fairseq dump (`{split}_{shard}_{nshard}.npy`), a
    sub-folder `{split}/` of utterance files, and, with `loose_files` (the
    training split; by default when `split` is 'train'), utterance files directly
    in `data_dir` unless it is a fairseq dump (whose shards are not utterances).
    """
    shards = _fairseq_shards(data_dir, split)
    if shards:
        return _open_fairseq(data_dir, split, shards)
    sub = data_dir / split
    if sub.is_dir() and any(p.suffix in UTTERANCE_SUFFIXES for p in sub.iterdir()):
        return _open_directory(sub, split, pending, manifest_dir)
    if loose_files is None:
        loose_files = split == TRAIN_SPLIT
    if loose_files and any(p.suffix in UTTERANCE_SUFFIXES for p in data_dir.iterdir()) \
            and not dump_splits(data_dir):
        return _open_directory(data_dir, split, pending, manifest_dir)
    return None


HOLDOUT = 0.02  # the share of training utterances held out for evaluation when there is no valid split
AUDIO_LOOK = 1000  # folder entries looked at for audio files in a --data_dir that holds no features: a hint only


def _audio_hint(data_dir: Path, split: str) -> str:
    """When `data_dir` (or its first sub-folders) holds audio files, the extractor's command that makes features
    of them; '' otherwise. Looks at a bounded number of entries: a corpus folder can hold millions."""
    seen, folders = 0, [data_dir]
    while folders and seen < AUDIO_LOOK:
        try:
            entries = sorted(itertools.islice(os.scandir(folders.pop(0)), AUDIO_LOOK - seen), key=lambda e: e.name)
        except OSError:
            continue
        seen += len(entries)
        for entry in entries:
            if os.path.splitext(entry.name)[1].lower() in AUDIO_SUFFIXES:
                feats = data_dir.parent / f"{data_dir.name}_features"
                found = Path(entry.path).relative_to(data_dir)
                return (f". It holds audio ({found}): the trainer reads features; extract them first, e.g. "
                        f"`python -m tools.extract {data_dir} {split} 1 0 {feats}`, then give --data_dir {feats}")
            if entry.is_dir(follow_symlinks=False):
                folders.append(Path(entry.path))
    return ""


def absent_folder(flag: str, folder: Path) -> BadInputError:
    """`FLAG FOLDER does not exist`, saying where it was looked for when the path given is relative."""
    where = "" if folder.is_absolute() else f": looked for {folder.absolute()}, from the folder the command ran in"
    return BadInputError(f"{flag} {folder} does not exist{where}")


def open_stores(data_dir: str | Path, train_split: str, valid_split: str, *, seed: int, holdout: float = HOLDOUT,
                manifest_dir: Path | None = None, pending: list | None = None):
    """Open the training and held-out stores; returns (train, valid, note).

    When `valid_split` is the default ('valid') and absent, a fixed share of the
    training utterances (chosen from `seed`) is held out, and `note` says so; any
    other split name that names no split is an error. `manifest_dir` and
    `pending`: where read-only folders' lengths manifests are looked for, and
    the list that collects those to save (`_open_directory`).
    """
    data_dir = Path(data_dir)
    if valid_split == train_split:
        log.warning("--train_split and --valid_split both name '%s': the held-out figures (the evals, the final "
                    "rel_mse) will be scores on the training data", train_split)
    if not data_dir.exists():
        raise absent_folder("--data_dir", data_dir)
    if not data_dir.is_dir():
        raise BadInputError(f"--data_dir {data_dir} is not a folder")
    train = find_split(data_dir, train_split, loose_files=True, pending=pending, manifest_dir=manifest_dir)
    if train is None and split_names(data_dir):
        raise missing_split(data_dir, train_split, "--train_split")
    if train is None:
        raise BadInputError(
            f"no training features found in {data_dir}: expected a fairseq dump "
            f"({train_split}_0_1.npy with {train_split}_0_1.len), a folder {train_split}/ of "
            ".npy/.pt arrays [T, D], or such arrays directly in the folder" + _audio_hint(data_dir, train_split)
        )
    if len(train) == 0:
        raise BadInputError(f"no training features found: {train.description} holds no utterances")
    valid = find_split(data_dir, valid_split, loose_files=False, pending=pending, manifest_dir=manifest_dir)
    note = None
    if valid is None and valid_split != VALID_SPLIT:  # a split the user named: a typo must not become a holdout
        raise missing_split(data_dir, valid_split, "--valid_split")
    if valid is None:
        if len(train) < 2:
            raise BadInputError(f"{train.description} has {len(train)} utterance; at least 2 are needed to hold one out")
        order = np.random.default_rng(seed).permutation(len(train))
        n_valid = max(1, int(round(holdout * len(train))))
        held, kept = np.sort(order[:n_valid]), np.sort(order[n_valid:])
        note = (
            f"no '{valid_split}' split in {data_dir}: holding out {n_valid} of {len(train)} "
            f"training utterances ({holdout:.0%}, fixed by --seed) for evaluation"
        )
        valid = train.subset(held, f"{train.description}, held out")
        train = train.subset(kept, train.description)
    elif valid.dim != train.dim:
        raise BadInputError(
            f"feature dims differ between splits: '{train_split}' has {train.dim}, '{valid_split}' has {valid.dim}"
        )
    return train, valid, note


def non_finite_utterances(store: FeatureStore, show_progress: bool = True):
    """Yield the index of every utterance with a NaN or Inf value, reading every frame (with a progress bar)."""
    for i in tqdm(range(len(store)), desc=f"checking {store.description}", disable=not show_progress,
                  unit="utt", mininterval=1.0):
        if not np.isfinite(store.utterance(i)).all():
            yield i
