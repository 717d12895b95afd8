"""A codec over a feature store: a share of a split (shard RANK of NSHARD, as fairseq's simple_kmeans cuts one),
opened and checked to be the features the codec was trained on, as tools.encode and tools.evaluate read them.

The features must be those the codec was trained on: where the dump has tools.extract's notes and the checkpoint
records its features, their settings must agree (naming those that differ), but for the dump's dtype alone (float16
or float32: read as float32, and said); otherwise the statistics of the share's first frames must lie within
PLAUSIBLE_SHIFT of those the codec was trained on (data/feature_settings.py). `allow_mismatch` encodes anyway, and
says so."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.audio.features import FEATURES
from data.dump_writer import shard_range
from data.feature_settings import (PLAUSIBLE_SHIFT, STATS_FRAMES, dump_feature_settings, feature_shift,
                                   front_ends_differ, settings_differ, stored_differently)
from data.stores import FeatureStore, absent_folder, find_split, missing_split
from errors import BadInputError
from models.codec import CodecConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitShare:
    """Shard RANK of NSHARD of a split in a folder: a feature store (--data_dir), or the codes tools.encode wrote of
    it (decode's --codes_dir)."""

    folder: Path
    split: str
    nshard: int
    rank: int

    @property
    def name(self) -> str:
        """The shard's NAME in its outputs."""
        return f"{self.split}_{self.rank}_{self.nshard}"


def open_share(data: SplitShare, config: CodecConfig, ckpt_path: Path) -> tuple[FeatureStore, int, int, int]:
    """(this rank's share of the split, its first utterance, its end, the split's utterances), checked against the
    codec. The split's metadata are read; only the share's sources stay open."""
    if not data.folder.exists():
        raise absent_folder("--data_dir", data.folder)
    if not data.folder.is_dir():
        raise BadInputError(f"--data_dir {data.folder} is not a folder")
    split = find_split(data.folder, data.split)  # utterance files directly in --data_dir: 'train', as trained
    if split is None:
        raise missing_split(data.folder, data.split, "--split")
    if len(split) == 0:
        raise BadInputError(f"{split.description} holds no utterances")
    if split.dim != config.feature_dim:
        raise BadInputError(f"{split.description} has {split.dim}-d features; the codec in {ckpt_path} was "
                            f"trained on {config.feature_dim}-d")
    start, end = shard_range(len(split), data.nshard, data.rank)
    if start == end:
        raise BadInputError(f"shard {data.rank} of {data.nshard} is empty: the split has {len(split)} utterances")
    return split.share(start, end), start, end, len(split)


def check_features(data: SplitShare, state: dict, model, store: FeatureStore, ckpt_path: Path, *,
                   allow_mismatch: bool) -> tuple[dict, str]:
    """(the dump's features as the codes record them, how they were found to be the codec's). BadInputError when
    they are not: tools.extract's settings that differ from the checkpoint's record, or else first frames whose
    statistics are further than PLAUSIBLE_SHIFT from the codec's (--allow_feature_mismatch: warned, and encoded)."""
    dump = dump_feature_settings(data.folder, data.split)
    features = {k: v for k, v in dump.items() if k not in ("checkpoint", "note")}  # the model by its fingerprint
    trained = (state.get("config") or {}).get("features") or {}
    where = f"split '{data.split}' of {data.folder}"
    if dump["feature"] == "mixed":
        problem = dump["note"]
    elif dump["feature"] in FEATURES and trained.get("feature") in (*FEATURES, "demo"):
        stored = stored_differently(trained, dump)
        differ = settings_differ(trained, {**dump, "dtype": trained.get("dtype")} if stored else dump)
        if not differ:
            if front_ends := front_ends_differ(trained, dump):  # the same features (data/feature_settings.py)
                log.info("%s: the codec's fbank and the dump's come from different front-ends (%s), the same "
                         "features within 1e-4", where, front_ends)
            if stored:
                log.info("%s: the features are %s: the same features, read as float32", where, stored)
                return features, f"tools.extract's settings are the codec's, the features {stored}"
            return features, "tools.extract's settings are the codec's"
        problem = f"the features of {where} are not those the codec in {ckpt_path} was trained on ({differ})"
    else:  # no notes on one side: the features' statistics against those the codec normalises by
        frames, n = [], 0
        for i in range(len(store)):
            if n >= STATS_FRAMES:
                break
            frames.append(np.asarray(store.utterance(i)[: STATS_FRAMES - n], dtype=np.float64))  # a memmap's slice
            n += len(frames[-1])
        shift = feature_shift(np.concatenate(frames), model.feature_mean.cpu().double().numpy(),
                              model.feature_std.cpu().double().numpy())
        check = f"the statistics of the first {n} frames, {shift:.3f} nats per dimension from the codec's"
        if shift <= PLAUSIBLE_SHIFT:
            return features, check + f" (at most {PLAUSIBLE_SHIFT})"
        problem = (f"the first {n} frames of {where} are {shift:.2f} nats per dimension from the statistics of the "
                   f"features the codec in {ckpt_path} was trained on (at most {PLAUSIBLE_SHIFT} for its own)")
    if allow_mismatch:
        log.warning("%s; encoding anyway (--allow_feature_mismatch)", problem)
        return features, f"not the codec's, encoded under --allow_feature_mismatch: {problem}"
    raise BadInputError(f"{problem}: its codes of other features would be meaningless. Encode the features the codec "
                        "was trained on (tools.extract with its settings), or pass --allow_feature_mismatch to encode "
                        "these anyway")
