"""A trained codec from a checkpoint file or a run's --output_dir, for the tools that use one (encode, export)."""
from __future__ import annotations

from pathlib import Path

import torch

from errors import BadInputError
from models.codec import CodecConfig, RVQCodec
from training.checkpoint import load_checkpoint, load_latest, unreadable_reason


def load_codec(path: str | Path, device: str | torch.device = "cpu") -> tuple[RVQCodec, dict, Path]:
    """(model in eval mode, checkpoint dict, checkpoint file) from a checkpoint file or a run folder (its newest)."""
    path = Path(path)
    if path.is_dir():
        found = load_latest(path / "checkpoints") or load_latest(path)
        if found is None:
            raise BadInputError(f"--checkpoint {path}: no readable step_*.pt in {path}/checkpoints or {path}")
        path, state = found
    elif path.is_file():
        try:
            state = load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file is the user's to fix
            raise BadInputError(f"--checkpoint {path} could not be read: {unreadable_reason(path, e)}") from None
    else:
        raise BadInputError(f"--checkpoint {path} does not exist: give a checkpoint file or a run's --output_dir")
    if not isinstance(state, dict) or "model" not in state or "codec" not in state:
        raise BadInputError(f"--checkpoint {path} is not a checkpoint of rvq_seamless_gpu_cache_nccl.py "
                            "(no 'model' and 'codec' entries)")
    model = RVQCodec(CodecConfig(**state["codec"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state, path
