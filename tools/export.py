"""Export a trained codec as safetensors + JSON, usable without this repo.

    python -m tools.export RUN_DIR_OR_CKPT OUT_DIR [--feature fbank|w2v-bert|...] [--overwrite]

Writes OUT_DIR/codec.safetensors (float32 tensors) and OUT_DIR/codec.json, which
names the tensors and says how to use them, an utterance's tail padding and cut
included (the format is models/export_format.py's).
The same JSON is stored in the safetensors metadata under "codec_json". The
feature kind recorded is what the checkpoint says the codec was trained on
(tools.extract's settings, data/feature_settings.py); --feature names it for a
checkpoint that does not say, and one naming another kind is refused. The JSON
also records the checkpoint's step, the digest of its weights (as code shards
record it) and the full settings of its features, so that rvq_tokenizer.load
takes the folder as it takes the run. An OUT_DIR holding an export of the same
codec is written again; one holding another codec's export, or a codec.json or
codec.safetensors this tool did not write, is refused unless --overwrite.
Exit codes: 0 done, 2 no readable checkpoint, a --feature the checkpoint
contradicts or an OUT_DIR refused (nothing written), 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from data.dump_writer import output_folder
from data.feature_settings import dump_feature_settings
from errors import EXIT_OK, Asker, BadInputError
from models.export_format import FORMAT, NOTE, WEIGHTS, describe, export_tensors
from rvq_tokenizer.codec_files import codec_digest, load_codec
from tools.cli import bad_input_exits_2, run
from training.flag_help import FlagHelpFormatter

log = logging.getLogger("export")
POSITIONAL = Asker(python=False, positional=("checkpoint",))  # the checkpoint is this command's first argument


def trained_on(state: dict) -> dict:
    """The settings of the features the codec was trained on: the checkpoint's record of tools.extract's settings,
    or (a checkpoint from before the trainer recorded them) the notes beside the training data, if they are still
    there."""
    config = state.get("config") or {}
    return config.get("features") or dump_feature_settings(config.get("data_dir"), config.get("train_split", "train"))


def feature_kind(settings: dict) -> dict:
    """The features' kind and what names them, from their `settings` (trained_on)."""
    keep = ("checkpoint", "layer", "frame_rate_hz", "sample_rate", "note")
    return {"kind": settings.get("feature", "unknown"), **{k: settings[k] for k in keep if k in settings}}


def named_kind(settings: dict, feature: str | None) -> dict:
    """The feature kind to record: the checkpoint's (`settings`), or `feature` where it says none. BadInputError for a
    `feature` other than the kind the checkpoint records."""
    recorded = settings.get("feature")
    if feature and recorded and feature != recorded:
        raise BadInputError(f"--feature {feature}: the checkpoint says the codec was trained on {recorded} features; "
                            "leave --feature out (it names the kind only for a checkpoint that does not say)")
    return feature_kind(settings) if recorded or not feature else {"kind": feature}


def held_export(out_dir: Path, digest: str, overwrite: bool) -> None:
    """BadInputError, unless `overwrite`, when `out_dir` holds a codec.json or codec.safetensors other than an export
    of the codec of `digest` (which is written again): another codec's export, or files this tool did not write."""
    note, weights = out_dir / NOTE, out_dir / WEIGHTS
    if overwrite or not (note.exists() or weights.exists()):
        return
    try:
        meta = json.loads(note.read_text())
    except (OSError, ValueError):
        meta = None
    source = meta.get("checkpoint") if isinstance(meta, dict) and meta.get("format") == FORMAT else None
    if not isinstance(source, dict):
        held = NOTE if note.exists() else WEIGHTS
        raise BadInputError(f"OUT_DIR {out_dir} holds a {held} that python -m tools.export did not write: give "
                            "another folder, or --overwrite to replace it")
    if source.get("codec_digest") != digest:
        raise BadInputError(f"OUT_DIR {out_dir} holds the export of another codec ({source.get('path')}, step "
                            f"{source.get('step')}, digest {source.get('codec_digest')}): give another folder, or "
                            "--overwrite to replace it")


def export(checkpoint: Path, out_dir: Path, feature: str | None = None,
           overwrite: bool = False) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    model, state, ckpt_path = load_codec(checkpoint, asker=POSITIONAL)
    settings = trained_on(state)
    kind = named_kind(settings, feature)
    digest = codec_digest(state["model"])
    meta = describe(model, state, ckpt_path, kind, digest, settings)
    tensors = export_tensors(model)
    output_folder(out_dir, "OUT_DIR")
    held_export(out_dir, digest, overwrite)
    weights, note = out_dir / WEIGHTS, out_dir / NOTE
    text = json.dumps(meta, indent=1) + "\n"
    save_file(tensors, str(weights) + ".tmp", metadata={"codec_json": json.dumps(meta)})
    os.chmod(str(weights) + ".tmp", 0o644)  # safetensors creates it owner-only; it is meant to be shared
    note.with_name(note.name + ".tmp").write_text(text)
    os.replace(str(weights) + ".tmp", weights)
    os.replace(note.with_name(note.name + ".tmp"), note)
    log.info("exported %s (step %s): %d levels x %d codes of dim %d, latent %d, downsample %d, %s features -> %s",
             ckpt_path, state.get("step"), meta["levels"], meta["codebook_size"], meta["codebook_dim"],
             meta["latent_dim"], meta["downsample"], kind["kind"], out_dir)
    return weights, note


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.export", formatter_class=FlagHelpFormatter,
                                description="Export a trained codec as codec.safetensors + codec.json.")
    p.add_argument("checkpoint", type=Path, help="a checkpoint file, or a run's --output_dir (its newest checkpoint)")
    p.add_argument("out_dir", type=Path, help="the folder codec.safetensors and codec.json are written to")
    p.add_argument("--feature", help="the feature kind to record for a checkpoint that does not say what the codec "
                                     "was trained on (default: what the checkpoint says; another kind is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a codec.json or codec.safetensors in out_dir that is not an export of this codec")
    return p


@bad_input_exits_2(log)
def main(argv=None) -> int:
    args = build_parser().parse_args(None if argv is None else [str(a) for a in argv])
    export(args.checkpoint, args.out_dir, args.feature, args.overwrite)
    log.info("finished successfully")
    return EXIT_OK


if __name__ == "__main__":
    run(main, "export")
