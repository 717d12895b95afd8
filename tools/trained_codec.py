"""A trained codec from a checkpoint file or a run's --output_dir, for the tools that use one (encode, tokenize,
export), described in the log when loaded; and what the two that write codes with it share: their flags and the
settings a code shard records (the rules a code shard's folder keeps, one codec and one count of shards a split:
data/resumable_shard.py ShardWriter.begin).

A codec's identity is the digest of its weights (`codec_digest`), recorded with its checkpoint file and step by
every code shard from its start: the same weights give the same codes, wherever the file lies.
`--checkpoint RUN` takes the newest checkpoint of a run that has ended; a run still training (its --output_dir
lock held) is refused, since its newest checkpoint changes under the shards of one output; a checkpoint file of
it is taken as given.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.codes_parquet import require_pyarrow
from data.pass_plan import by_device, device_defaults
from data.writer_lock import WriterLock
from errors import BadInputError, TransientFault
from models.codec import CodecConfig, RVQCodec
from models.codes import code_dtype
from models.export_format import FORMAT, NOTE, WEIGHTS, codec_from_export
from training.checkpoint import load_checkpoint, load_latest, unreadable_reason
from training.run_folder import CHECKPOINTS, RunFolder

log = logging.getLogger("codec")

# A codec is trusted when its schedule ended with a final eval, after at least this many steps, with a rel_mse
# below this: a shorter run (a --max_minutes budget spent on the k-means init) gives codes of little meaning
TRUSTED_STEPS = 100
TRUSTED_REL_MSE = 0.5


def load_codec(path: str | Path, device: str | torch.device = "cpu") -> tuple[RVQCodec, dict, Path]:
    """(model in eval mode, checkpoint dict, checkpoint file) from a checkpoint file or a run folder (its newest, once
    the run has ended); the codec's step and last eval are logged, and a schedule too short to trust warned about."""
    path = Path(path)
    if path.is_dir():
        refuse_a_run_in_progress(path)
        found = load_latest(RunFolder(path).checkpoints) or load_latest(path)
        if found is None:
            raise BadInputError(f"--checkpoint {path}: no readable step_*.pt in {path}/checkpoints or {path}")
        path, state = found
    elif path.is_file():
        try:
            state = load_checkpoint(path)
        except TransientFault:  # an OS error or exhausted memory while reading: not the file's fault, exit 1
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file is the user's to fix
            raise BadInputError(f"--checkpoint {path} could not be read: {unreadable_reason(path, e)}") from None
    else:
        raise BadInputError(f"--checkpoint {path} does not exist: give a checkpoint file or a run's --output_dir")
    if not isinstance(state, dict) or "model" not in state or "codec" not in state:
        raise BadInputError(f"--checkpoint {path} is not a checkpoint of rvq_seamless_gpu_cache_nccl.py "
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


def refuse_a_run_in_progress(folder: Path) -> None:
    """BadInputError when `folder` (a run's --output_dir, or its checkpoints/) belongs to a run still training: its
    newest checkpoint is not its last."""
    for run_dir in (folder, folder.parent) if folder.name == CHECKPOINTS else (folder,):
        lock = WriterLock(RunFolder(run_dir).lock, f"--output_dir {run_dir}")
        if lock.taken():
            newest = next(iter(sorted(RunFolder(run_dir).checkpoints.glob("step_*.pt"), reverse=True)), None)
            raise BadInputError(
                f"--checkpoint {folder}: the run is still training ({lock.holder()}); its newest checkpoint will "
                "change under the shards of one output. Wait for it to end, or give one checkpoint file"
                + (f" (such as {newest})" if newest else ""))


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


def add_codes_args(p: argparse.ArgumentParser, km: bool = True) -> None:
    """The flags of tools.encode and tools.tokenize that choose the codes (tools.evaluate's, without --km)."""
    p.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    p.add_argument("--beam_size", type=int,
                   help="partial code sequences kept per frame by the quantizer's beam search over the levels "
                        "(1: the nearest code at each level, several times faster); default: the codec's "
                        "--beam_size, the one its codebooks were refit for (benchmarks/README.md)")
    p.add_argument("--batch_frames", type=int,
                   help="feature frames per codec forward pass, counted padded (rows x the longest utterance in the "
                        "batch; a longer utterance goes alone); default: "
                        + by_device("codec_batch_frames"))
    if not km:
        return
    p.add_argument("--km", type=int, nargs="?", const=1, metavar="LEVEL",
                   help="also write NAME.km, fairseq's label file (HuBERT's dump_km_label.py): one line per "
                        "utterance, its codes at level LEVEL (from 1; --km alone: 1) (default: no .km)")
    p.add_argument("--parquet", action="store_true",
                   help="also write NAME.codes.parquet once the shard is finished (or found finished without it): "
                        "a row per utterance, its key and its codes at each level, as datasets.load_dataset"
                        "('parquet') reads it (needs pip install -r requirements-sources.txt)")


@dataclass(frozen=True)
class CodesRequest:
    """The codes the flags of add_codes_args ask for; None: the codec's own (or no .km)."""

    num_quantizers: int | None
    beam_size: int | None
    batch_frames: int | None  # None: the device's default (data/pass_plan.py DEVICE_DEFAULTS)
    km: int | None  # the level also written as NAME.km
    parquet: bool


def codes_request(p: argparse.ArgumentParser, args: argparse.Namespace) -> CodesRequest:
    """The flags of add_codes_args as a CodesRequest; argparse's exit 2 for values out of range."""
    km = getattr(args, "km", None)  # tools.evaluate's flags have no --km nor --parquet
    for name, value in (("beam_size", args.beam_size), ("batch_frames", args.batch_frames), ("km", km)):
        if value is not None and value < 1:  # --num_quantizers: codes_spec names the codec's levels
            p.error(f"--{name} must be positive, got {value}")
    parquet = getattr(args, "parquet", False)
    if parquet:
        require_pyarrow()  # before any work: exit 2 naming the install line
    return CodesRequest(args.num_quantizers, args.beam_size, args.batch_frames, km, parquet)


@dataclass
class CodesSpec:
    """The codes a tool writes with a codec: levels kept, beam, integer type, .km level; `settings` are what a
    code shard records and is resumed with."""

    model: RVQCodec
    levels: int
    beam: int
    dtype: np.dtype
    km: int | None
    batch_frames: int
    settings: dict


def codes_spec(request: CodesRequest, model: RVQCodec, state: dict, ckpt_path: Path,
               device: torch.device) -> CodesSpec:
    """The codes asked for by the flags of add_codes_args; BadInputError for levels this codec lacks."""
    config = model.config
    q = config.num_quantizers if request.num_quantizers is None else request.num_quantizers
    if not 1 <= q <= config.num_quantizers:
        raise BadInputError(f"--num_quantizers {q}: this codec has levels 1 to {config.num_quantizers}")
    if request.km is not None and request.km > q:
        raise BadInputError(f"--km {request.km}: the codes have levels 1 to {q}")
    beam, dtype = request.beam_size or config.beam_size, code_dtype(config.codebook_size)
    if beam > config.codebook_size:  # the search keeps at most one sequence per code of the first level
        raise BadInputError(f"--beam_size {beam}: this codec has {config.codebook_size} codes a level, so the beam can "
                            f"be {config.codebook_size} wide at most")
    settings = {"checkpoint": str(ckpt_path.resolve()), "step": state.get("step"),
                "codec_digest": recorded_digest(state), "levels": q,
                "codebook_size": config.codebook_size, "downsample": config.downsample, "dtype": dtype.name,
                "feature_dim": config.feature_dim, "beam_size": beam, "km_level": request.km}
    batch_frames = request.batch_frames or device_defaults(device.type).codec_batch_frames
    return CodesSpec(model, q, beam, dtype, request.km, batch_frames, settings)


def describe_codes(spec: CodesSpec) -> str:
    """The codes in words, for the log."""
    config = spec.model.config
    return (f"{spec.levels} of {config.num_quantizers} levels x {config.codebook_size} codes, downsample "
            f"{config.downsample}, {spec.dtype}"
            + (f", beam search {spec.beam} wide" if spec.beam > 1 else ", the nearest code at each level")
            + (f", level {spec.km} also as NAME.km" if spec.km else ""))
