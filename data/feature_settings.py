"""What features a dump holds and a codec was trained on: the settings tools.extract notes in the .json beside
each shard, which the trainer records in its checkpoints (config "features") and tools.tokenize computes again.

They are what makes the features what they are: the kind (`fbank`, `w2v-bert`) and dim; for w2v-BERT the model
(its folder, and a fingerprint of its files, the same wherever the folder is copied), the layer, the chunk
length and the precision; and the dump's dtype (float16 rounds the features). Batch and commit sizes are not
among them: padding changes the last bits of a layer's output, not what the features are.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

FEATURE_KEYS = ("feature", "dim", "frame_rate_hz", "sample_rate", "checkpoint", "model", "layer",
                "max_chunk_seconds", "precision", "dtype")
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


def feature_settings(note: dict) -> dict:
    """The feature settings among a tools.extract note's entries."""
    return {key: note[key] for key in FEATURE_KEYS if key in note}


def dump_feature_settings(data_dir: str | Path | None, split: str) -> dict:
    """The feature settings of `split` in `data_dir`, from tools.extract's notes beside its shards (what the trainer
    records): {"feature": "demo"} for the built-in demo corpus (no data dir); "unknown" when no shard has a
    note (features from another tool); "mixed" when the shards' notes disagree."""
    if data_dir is None:
        return {"feature": "demo", "note": "the trainer's synthetic demo corpus (160-d, like the Seamless fbank)"}
    folder, pattern = Path(data_dir), re.compile(rf"^{re.escape(split)}_\d+_\d+\.json$")
    found = {}
    for path in sorted(folder.glob(f"{split}_*_*.json")) if folder.is_dir() else []:
        if pattern.match(path.name) and path.with_suffix(".npy").is_file():
            try:
                note = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(note, dict) and "feature" in note:
                found[path.name] = feature_settings(note)
    if not found:
        return {"feature": "unknown", "note": f"split '{split}' of {data_dir} has no tools.extract notes"}
    kinds = {json.dumps(s, sort_keys=True): name for name, s in found.items()}
    if len(kinds) > 1:
        return {"feature": "mixed", "note": f"the shards of split '{split}' of {data_dir} were extracted with "
                                            f"different settings ({', '.join(sorted(kinds.values()))} differ)"}
    return next(iter(found.values()))


def describe(settings: dict) -> str:
    """The features in words: `fbank (160-d, float32)`, `w2v-bert layer 17 of /models/w2v (1024-d, ...)`."""
    kind = settings.get("feature", "unknown")
    if kind not in ("fbank", "w2v-bert"):
        return f"{kind} features ({settings.get('note', 'no tools.extract settings')})"
    details = [f"{settings.get('dim')}-d"]
    if kind == "w2v-bert":
        details += [f"{settings.get('precision')}", f"chunks of at most {settings.get('max_chunk_seconds')} s",
                    f"model {settings.get('model')}"]
    details.append(f"stored as {settings.get('dtype')}")
    where = f" layer {settings.get('layer')} of {settings.get('checkpoint')}" if kind == "w2v-bert" else ""
    return f"{kind}{where} ({', '.join(details)})"


def settings_differ(trained: dict, now: dict) -> str:
    """`key: trained -> now` for each feature setting that differs ('' when none does). A model is known by its
    fingerprint, wherever its folder is; by its folder where the record has no fingerprint (notes from before
    there were any)."""
    fingerprinted = "model" in trained
    keys = [k for k in FEATURE_KEYS if k != ("checkpoint" if fingerprinted else "model")]
    return ", ".join(f"{k}: {trained.get(k)!r} -> {now.get(k)!r}" for k in keys if trained.get(k) != now.get(k))
