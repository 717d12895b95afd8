"""Feature stores on disk: fairseq dumps and directories of per-utterance arrays.

A store is a list of utterances, each a ``[T, D]`` array, read lazily
(``np.load(mmap_mode="r")``). ``open_split`` finds and validates one split;
every problem a user can fix raises ``BadInputError`` naming the file.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from errors import BadInputError

log = logging.getLogger(__name__)

UTTERANCE_SUFFIXES = (".npy", ".pt")


@dataclass
class FeatureStore:
    """Utterances of one split. `lengths[i]` frames of `dim` features each."""

    description: str
    lengths: np.ndarray
    dim: int
    _shards: list = field(repr=False)  # fairseq: memmapped arrays; directory: file paths
    _where: list = field(repr=False)  # per utterance: (shard index, first row)
    _names: list = field(repr=False)  # per utterance: a name for messages

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_frames(self) -> int:
        return int(self.lengths.sum())

    def name(self, i: int) -> str:
        return self._names[i]

    def utterance(self, i: int) -> np.ndarray:
        """The `[T, D]` array of utterance i (a memory-mapped view where possible)."""
        shard, row = self._where[i]
        source = self._shards[shard]
        if isinstance(source, Path):
            return _load_array(source)
        return source[row : row + int(self.lengths[i])]

    def subset(self, indices, description: str) -> "FeatureStore":
        indices = list(indices)
        return FeatureStore(
            description,
            self.lengths[indices],
            self.dim,
            self._shards,
            [self._where[i] for i in indices],
            [self._names[i] for i in indices],
        )


def _load_array(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    import torch

    value = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(value, torch.Tensor):
        raise BadInputError(f"{path}: expected a tensor of shape [T, D], found {type(value).__name__}")
    return value.float().numpy()


def _fairseq_shards(folder: Path, split: str) -> list[Path]:
    pattern = re.compile(rf"^{re.escape(split)}_(\d+)_(\d+)\.npy$")
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
        names = ", ".join(f"{split}_{s}_{nshard}.npy" for s in missing)
        raise BadInputError(f"{folder}: split '{split}' is missing shard(s) {names}")
    return [found[(s, nshard)] for s in range(nshard)]


def _open_fairseq(folder: Path, split: str, shard_paths: list[Path]) -> FeatureStore:
    shards, where, names, lengths, dims = [], [], [], [], {}
    for k, npy in enumerate(shard_paths):
        len_path = npy.with_suffix(".len")
        if not len_path.exists():
            raise BadInputError(f"{npy} has no {len_path.name} beside it (one frame count per line)")
        try:
            counts = [int(line) for line in len_path.read_text().split()]
        except ValueError:
            raise BadInputError(f"{len_path}: every line must be a whole number of frames") from None
        try:
            array = np.load(npy, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise BadInputError(f"{npy} is not a readable .npy array: {e}") from None
        if array.ndim != 2:
            raise BadInputError(f"{npy} has shape {array.shape}; a fairseq dump is 2-D [frames, dim]")
        if sum(counts) != array.shape[0]:
            raise BadInputError(
                f"{len_path.name} lists {sum(counts)} frames in total but {npy.name} has {array.shape[0]} rows; "
                "the .len file must give one frame count per utterance, in order"
            )
        dims[npy.name] = array.shape[1]
        shards.append(array)
        row = 0
        for j, n in enumerate(counts):
            where.append((k, row))
            names.append(f"{npy.name} utterance {j} (rows {row}-{row + n})")
            lengths.append(n)
            row += n
    dim = _one_dim(dims)
    warn_mixed_precision(split, shard_paths)
    desc = f"fairseq dump '{split}' in {folder} ({len(shard_paths)} shard(s))"
    return FeatureStore(desc, np.asarray(lengths, dtype=np.int64), dim, shards, where, names)


def warn_mixed_precision(split: str, shard_paths: list[Path]) -> dict[str, list[str]]:
    """Warns when a split's shards were extracted at different precisions (bf16 and fp32 features differ
    slightly: a model trained on one and evaluated on the other sees a shift). Reads the tools.extract
    .json beside each shard where there is one; returns {precision: [shard names]}."""
    by_precision: dict[str, list[str]] = {}
    for npy in shard_paths:
        meta = npy.with_suffix(".json")
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


def _open_directory(folder: Path, label: str) -> FeatureStore:
    files = sorted(p for p in folder.iterdir() if p.suffix in UTTERANCE_SUFFIXES and p.is_file())
    lengths, dims = [], {}
    for path in files:
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
    dim = _one_dim(dims)
    where = [(k, 0) for k in range(len(files))]
    return FeatureStore(
        f"directory of utterances '{label}' in {folder}",
        np.asarray(lengths, dtype=np.int64),
        dim,
        files,
        where,
        [str(p) for p in files],
    )


def _one_dim(dims: dict) -> int:
    values = sorted(set(dims.values()))
    if len(values) > 1:
        examples = {}
        for name, d in dims.items():
            examples.setdefault(d, name)
        detail = ", ".join(f"{name} has {d}" for d, name in sorted(examples.items()))
        raise BadInputError(f"feature dims differ within the store: {detail}; every utterance needs the same dim")
    return values[0] if values else 0


def find_split(data_dir: Path, split: str) -> FeatureStore | None:
    """The store of `split` in `data_dir`, or None when the split is not there.

    Looked for in order: a fairseq dump (`{split}_{shard}_{nshard}.npy`), a
    sub-folder `{split}/` of utterance files, and, for the training split only,
    utterance files directly in `data_dir`.
    """
    shards = _fairseq_shards(data_dir, split)
    if shards:
        return _open_fairseq(data_dir, split, shards)
    sub = data_dir / split
    if sub.is_dir() and any(p.suffix in UTTERANCE_SUFFIXES for p in sub.iterdir()):
        return _open_directory(sub, split)
    return None


def open_stores(data_dir: str | Path, train_split: str, valid_split: str, *, seed: int, holdout: float = 0.02):
    """Open the training and held-out stores; returns (train, valid, note).

    When `valid_split` is absent, a fixed share of the training utterances
    (chosen from `seed`) is held out, and `note` says so.
    """
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise BadInputError(f"--data_dir {data_dir} does not exist")
    if not data_dir.is_dir():
        raise BadInputError(f"--data_dir {data_dir} is not a folder")
    train = find_split(data_dir, train_split)
    if train is None and any(p.suffix in UTTERANCE_SUFFIXES for p in data_dir.iterdir()):
        train = _open_directory(data_dir, train_split)
    if train is None or len(train) == 0:
        raise BadInputError(
            f"no training features found in {data_dir}: expected a fairseq dump "
            f"({train_split}_0_1.npy with {train_split}_0_1.len), a folder {train_split}/ of "
            ".npy/.pt arrays [T, D], or such arrays directly in the folder"
        )
    valid = find_split(data_dir, valid_split)
    note = None
    if valid is None:
        if len(train) < 2:
            raise BadInputError(f"{train.description} has {len(train)} utterance; at least 2 are needed to hold one out")
        order = np.random.default_rng(seed).permutation(len(train))
        n_valid = max(1, int(round(holdout * len(train))))
        held, kept = sorted(order[:n_valid]), sorted(order[n_valid:])
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


def check_finite(store: FeatureStore, show_progress: bool = True) -> None:
    """Raise BadInputError naming the first utterance with NaN or Inf values."""
    for i in tqdm(range(len(store)), desc=f"checking {store.description}", disable=not show_progress,
                  leave=False, mininterval=1.0):
        if not np.isfinite(store.utterance(i)).all():
            raise BadInputError(f"non-finite values (NaN or Inf) in {store.name(i)}; fix or remove that utterance")
