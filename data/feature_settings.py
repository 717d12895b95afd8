"""What features a dump holds and a codec was trained on: the settings tools.extract notes in the .json beside
each shard, which the trainer records in its checkpoints (config "features") and tools.tokenize computes again.

They are what makes the features what they are: the kind (`fbank`, `w2v-bert`) and dim; for w2v-BERT the model
(its folder, and a fingerprint of its files, the same wherever the folder is copied), the layer, the chunk
length and the precision; and the dump's dtype (float16 rounds the features). Batch and commit sizes are not
among them: padding changes the last bits of a layer's output, not what the features are. A codec reads a dump
of either dtype as float32, so a dump that differs from its training dump in the dtype alone is one it encodes,
saying so (stored_differently); a resumed run and tools.tokenize hold to the dtype recorded.

The fbank's front-end (`front_end`: `torch`, data/audio/fbank.py, or `transformers`, SeamlessM4TFeatureExtractor; none
recorded: `transformers`, the only one before) is recorded and shown, but two records that differ only there
are the same features: both compute the same fbank, equal within 1e-4 of a unit-variance feature
(tests/test_fbank.py), less than float16 storage rounds a value between 1 and 2 (up to 2^-11), which is a
difference. So a codec encodes a dump of either front-end, a run resumes on either, and a split may hold shards of
both; tools.tokenize computes the codec's own (`front_end`), so that its codes are bit for bit those of
tools.extract with that front-end followed by tools.encode.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from data.dump_writer import DUMP_DTYPES
from data.setting_changes import changes
from data.shard_layout import FEATURE_DUMP

FEATURE_KEYS = ("feature", "dim", "frame_rate_hz", "sample_rate", "front_end", "checkpoint", "model", "layer",
                "max_chunk_seconds", "precision", "dtype")
RECORDED_BEFORE = "transformers"  # the front-end of a record that names none: the only one before
MODEL_FILES = ("config.json", "preprocessor_config.json")
FINGERPRINT_BYTES = 1 << 20  # of each weight file, at either end: tensors differ there, and it reads in ms


def model_fingerprint(folder: Path) -> str:
    """A digest of a model folder: its config files, and each weight file's name, size, first and last MiB."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name in MODEL_FILES:
            digest.update(path.name.encode() + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin") and path.is_file():
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}".encode())
            with open(path, "rb") as f:
                digest.update(f.read(FINGERPRINT_BYTES))
                f.seek(max(0, size - FINGERPRINT_BYTES))
                digest.update(f.read(FINGERPRINT_BYTES))
    return "sha256:" + digest.hexdigest()[:16]


def front_end(settings: dict) -> str:
    """The fbank front-end that made features of these settings: the recorded one, else `transformers`."""
    return settings.get("front_end") or RECORDED_BEFORE


def feature_settings(note: dict) -> dict:
    """The feature settings among a tools.extract note's entries."""
    return {key: note[key] for key in FEATURE_KEYS if key in note}


def dump_feature_settings(data_dir: str | Path | None, split: str) -> dict:
    """The feature settings of `split` in `data_dir`, from tools.extract's notes beside its shards (what the trainer
    records): {"feature": "demo"} for the built-in demo corpus (no data dir); "unknown" when no shard has a
    note (features from another tool); "mixed" when the shards' notes disagree."""
    if data_dir is None:
        return {"feature": "demo", "note": "the trainer's synthetic demo corpus (160-d, like the Seamless fbank)"}
    meta, array = FEATURE_DUMP.meta, FEATURE_DUMP.array
    folder, pattern = Path(data_dir), re.compile(rf"^{re.escape(split)}_\d+_\d+{re.escape(meta)}$")
    found = {}
    for path in sorted(folder.glob(f"{split}_*_*{meta}")) if folder.is_dir() else []:
        if pattern.match(path.name) and path.with_name(path.name[: -len(meta)] + array).is_file():
            try:
                note = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(note, dict) and "feature" in note:
                found[path.name] = feature_settings(note)
    if not found:
        return {"feature": "unknown", "note": f"split '{split}' of {data_dir} has no tools.extract notes"}
    kinds = {json.dumps({k: v for k, v in s.items() if k != "front_end"}, sort_keys=True): name
             for name, s in found.items()}
    if len(kinds) > 1:
        return {"feature": "mixed", "note": f"the shards of split '{split}' of {data_dir} were extracted with "
                                            f"different settings ({', '.join(sorted(kinds.values()))} differ)"}
    front_ends = sorted({front_end(s) for s in found.values()})
    settings = next(iter(found.values()))
    if len(front_ends) > 1:  # the same features (module doc): the record names each front-end that made them
        settings = {**settings, "front_end": "+".join(front_ends)}
    return settings


def describe(settings: dict) -> str:
    """The features in words: `fbank (160-d, float32)`, `w2v-bert layer 17 of /models/w2v (1024-d, ...)`; a
    setting the record lacks is left out, never shown as None."""
    kind = settings.get("feature", "unknown")
    if kind not in ("fbank", "w2v-bert"):
        return f"{kind} features ({settings.get('note', 'no tools.extract settings')})"
    known = {k: v for k, v in settings.items() if v is not None}
    details = [f"{known['dim']}-d"] if "dim" in known else []
    if kind == "w2v-bert":
        details += [known["precision"]] if "precision" in known else []
        details += [f"chunks of at most {known['max_chunk_seconds']} s"] if "max_chunk_seconds" in known else []
        details += [f"model {known['model']}"] if "model" in known else []
    details += [f"stored as {known['dtype']}"] if "dtype" in known else []
    details += [f"{known['front_end']} front-end"] if "front_end" in known else []
    where = f" layer {known['layer']}" if "layer" in known else ""
    where += f" of {known['checkpoint']}" if kind == "w2v-bert" and "checkpoint" in known else ""
    return f"{kind}{where}" + (f" ({', '.join(details)})" if details else "")


def settings_differ(trained: dict, now: dict) -> str:
    """`key: trained -> now` for each feature setting that differs ('' when none does); of other kinds of features,
    the kind alone (their other settings differ as a matter of course). A model is known by its fingerprint,
    wherever its folder is; by its folder where the record has no fingerprint (notes from before there were any).
    A setting one side lacks reads `(absent)`. The front-end is not a difference (module doc): front_ends_differ
    says when it differs."""
    if trained.get("feature") != now.get("feature"):
        keys = ["feature"]
    else:
        fingerprinted = "model" in trained
        keys = [k for k in FEATURE_KEYS if k not in ("checkpoint" if fingerprinted else "model", "front_end")]
    return ", ".join(changes(trained, now, keys, show=lambda value: "(absent)" if value is None else repr(value)))


def stored_differently(trained: dict, now: dict) -> str:
    """'' unless features of these settings differ in the dump's dtype, each one of tools.extract's (DUMP_DTYPES),
    and in nothing else; then `stored as now, trained on trained`, for a tool to say: the same features, one of
    them rounded to float16, which a codec reads widened to float32 either way."""
    was, new = trained.get("dtype"), now.get("dtype")
    if was == new or was not in DUMP_DTYPES or new not in DUMP_DTYPES:
        return ""
    if settings_differ(trained, {**now, "dtype": was}):
        return ""
    return f"stored as {new}, trained on {was}"


def front_ends_differ(trained: dict, now: dict) -> str:
    """'' when features of these settings come from the same fbank front-end, else `front-end: trained -> now`,
    for a tool to report (the same features: module doc)."""
    return ", ".join(changes({"front-end": front_end(trained)}, {"front-end": front_end(now)}, show=str))


# Features plausibly the codec's: the mean over dimensions of KL(N(sample mean, sample std) || N(codec mean, codec
# std)), in nats, at most this. Same-kind features stay far below it, features of another kind far above it
# (tests/test_codec_identity.py measures both); tools.encode applies it where a dump has no tools.extract notes.
PLAUSIBLE_SHIFT = 1.0
STATS_FRAMES = 2048  # the first frames of a share that the statistics are taken over


def feature_shift(frames: np.ndarray, mean: np.ndarray, std: np.ndarray) -> float:
    """How far `frames` [N, D] are from features of per-dimension `mean` and `std`: the mean over dimensions of the
    KL divergence of a Gaussian fitted to each dimension of `frames` from the codec's, in nats (0: the same)."""
    frames = np.asarray(frames, dtype=np.float64)
    frames = frames[np.isfinite(frames).all(1)]
    if len(frames) < 2:
        return 0.0  # nothing to judge by
    ratio = np.maximum(frames.std(0), 1e-5) / np.maximum(std, 1e-5)
    shift = (frames.mean(0) - mean) / np.maximum(std, 1e-5)
    return float(np.mean(0.5 * (shift ** 2 + ratio ** 2 - 1) - np.log(ratio)))
