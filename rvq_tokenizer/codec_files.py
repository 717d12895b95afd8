"""A trained codec read from where it lies: a checkpoint file, a run's --output_dir (its newest checkpoint, once the
run has ended), or a folder tools.export wrote; described in the log when loaded.

A codec's identity is the digest of its weights (`codec_digest`), recorded with its checkpoint file and step by
every code shard from its start: the same weights give the same codes, wherever the file lies. A run still
training (its --output_dir lock held) is refused, since its newest checkpoint changes under the shards of one
output; a checkpoint file of it is taken as given.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from data.writer_lock import WriterLock
from errors import COMMAND_LINE, Asker, BadInputError, TransientFault
from models.codec import CodecConfig, RVQCodec
from models.export_format import FORMAT, NOTE, WEIGHTS, codec_from_export
from training.checkpoint import load_checkpoint, load_latest, unreadable_reason
from training.run_folder import CHECKPOINTS, RunFolder

log = logging.getLogger("codec")

# A codec is trusted when its schedule ended with a final eval, after at least this many steps, with a rel_mse
# below this: a shorter run (a --max_minutes budget spent on the k-means init) gives codes of little meaning
TRUSTED_STEPS = 100
TRUSTED_REL_MSE = 0.5


def load_codec(path: str | Path, device: str | torch.device = "cpu", asker: Asker = COMMAND_LINE,
               exports: bool = False) -> tuple[RVQCodec, dict, Path]:
    """(model in eval mode, checkpoint dict, checkpoint file) from a checkpoint file or a run folder (its newest, once
    the run has ended); the codec's step and last eval are logged, and a schedule too short to trust warned about.
    BadInputError, in the `asker`'s words, for a path that holds no codec (naming an export folder among what to
    give when the caller takes one: `exports`, open_codec)."""
    path = Path(path)
    given = asker.option("checkpoint", path)
    sources = ("a run's folder (the trainer's output folder), one of its checkpoint files" if asker.python
               else "a checkpoint file or a run's --output_dir") + (
        ", or a folder python -m tools.export wrote" if exports else "")
    if path.is_dir():
        refuse_a_run_in_progress(path, asker)
        found = load_latest(RunFolder(path).checkpoints) or load_latest(path)
        if found is None:
            raise BadInputError(f"{given}: no readable step_*.pt in {path}/checkpoints or {path}: give {sources}")
        path, state = found
    elif path.is_file():
        try:
            state = load_checkpoint(path)
        except TransientFault:  # an OS error or exhausted memory while reading: not the file's fault, exit 1
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file is the user's to fix
            raise BadInputError(f"{given} could not be read: {unreadable_reason(path, e)}") from None
    else:
        raise BadInputError(f"{given} does not exist: give {sources}")
    if not isinstance(state, dict) or "model" not in state or "codec" not in state:
        raise BadInputError(f"{given} is not a checkpoint of rvq_seamless_gpu_cache_nccl.py "
                            "(no 'model' and 'codec' entries)")
    model = RVQCodec(CodecConfig(**state["codec"]))
    model.load_state_dict(state["model"])
    log_codec(path, state)
    return model.to(device).eval(), state, path


def is_export(path: Path) -> bool:
    """Whether `path` is a folder tools.export wrote (its codec.json)."""
    return path.is_dir() and (path / NOTE).is_file()


def load_exported(folder: Path, device: str | torch.device = "cpu") -> tuple[RVQCodec, dict, Path]:
    """(model in eval mode, what its checkpoint said of it as the export recorded it: step, `codec_digest` and the
    features it was trained on under config.features; its weights' file) from a folder tools.export wrote.
    BadInputError for a folder that does not hold a readable export, or one exported before exports recorded the
    digest and the features (export it again)."""
    from safetensors.torch import load_file

    note, weights = folder / NOTE, folder / WEIGHTS
    try:
        meta = json.loads(note.read_text())
        tensors = load_file(str(weights))
    except (OSError, ValueError) as e:  # safetensors' own errors are ValueErrors too
        raise BadInputError(f"{folder} holds no readable export ({e}): export the codec again with python -m "
                            "tools.export RUN_DIR OUT_DIR") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadInputError(f"{note} is not the JSON of an export of this repo's codec (format {FORMAT})")
    source = meta.get("checkpoint") or {}
    if not (source.get("features") and source.get("codec_digest")):
        raise BadInputError(f"{folder} was exported before exports recorded the codec's digest and the features it "
                            "was trained on: export it again with python -m tools.export "
                            f"{source.get('path', 'CHECKPOINT')} {folder}")
    model = codec_from_export(meta, tensors, folder)
    log.info("codec %s: exported from %s, step %s", folder, source.get("path"), source.get("step"))
    state = {"step": source.get("step"), "codec_digest": source.get("codec_digest"),
             "config": {"features": source["features"]}}
    return model.to(device).eval(), state, weights


def open_codec(path: str | Path, device: str | torch.device = "cpu",
               asker: Asker = COMMAND_LINE) -> tuple[RVQCodec, dict, Path]:
    """load_exported for a folder tools.export wrote, else load_codec: what rvq_tokenizer.load and the commands'
    --checkpoint take (the state of an export holds its step, codec_digest and features, no weights)."""
    path = Path(path)
    return load_exported(path, device) if is_export(path) else load_codec(path, device, asker, exports=True)


def refuse_a_run_in_progress(folder: Path, asker: Asker = COMMAND_LINE) -> None:
    """BadInputError when `folder` (a run's --output_dir, or its checkpoints/) belongs to a run still training: its
    newest checkpoint is not its last."""
    for run_dir in (folder, folder.parent) if folder.name == CHECKPOINTS else (folder,):
        lock = WriterLock(RunFolder(run_dir).lock, f"--output_dir {run_dir}")
        if lock.taken():
            newest = next(iter(sorted(RunFolder(run_dir).checkpoints.glob("step_*.pt"), reverse=True)), None)
            raise BadInputError(
                f"{asker.option('checkpoint', folder)}: the run is still training ({lock.holder()}); its newest "
                "checkpoint will change under the shards of one output. Wait for it to end, or give one checkpoint "
                "file" + (f" (such as {newest})" if newest else ""))


def codec_doubts(state: dict) -> list[str]:
    """Why a codec's schedule was too short to trust its codes ([] when it was not): no final eval, fewer than
    TRUSTED_STEPS steps, or a last rel_mse of TRUSTED_REL_MSE or more."""
    doubts = []
    if "final eval" not in (state.get("end_of_schedule") or []):
        doubts.append("its checkpoint holds no final eval (its schedule had not ended)")
    if state.get("step", 0) < TRUSTED_STEPS:
        doubts.append(f"it was trained {state.get('step', 0)} steps (fewer than {TRUSTED_STEPS})")
    rel_mse = (state.get("eval") or {}).get("rel_mse")
    if rel_mse is not None and rel_mse >= TRUSTED_REL_MSE:
        doubts.append(f"its rel_mse is {rel_mse:.3f} (at least {TRUSTED_REL_MSE}; 1 is a codec that outputs the mean)")
    return doubts


def log_codec(path: Path, state: dict) -> None:
    """The codec's step and last eval in the log; a warning when codec_doubts has any."""
    last = state.get("eval") or {}
    scored = ("final eval" if last.get("final") else f"eval at step {last.get('step')}") if last else ""
    log.info("codec %s: step %s, %s", path, state.get("step"),
             f"{scored} rel_mse {last['rel_mse']:.4f}" if "rel_mse" in last else "no eval recorded in its checkpoint")
    doubts = codec_doubts(state)
    if doubts:
        log.warning("the codec in %s may be too briefly trained to trust its codes: %s. Train it on (the same "
                    "--output_dir with a larger --max_steps or --max_minutes) before using its codes",
                    path, "; ".join(doubts))


def codec_digest(weights: dict) -> str:
    """A digest of a codec's weights (a model state dict): the same weights, the same digest, wherever the file."""
    digest = hashlib.sha256()
    for key in sorted(weights):
        tensor = weights[key].detach().cpu().contiguous()
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()[:16]


def recorded_digest(state: dict) -> str:
    """The codec_digest of a checkpoint's weights, or the one an export recorded (load_exported)."""
    return codec_digest(state["model"]) if "model" in state else state["codec_digest"]
