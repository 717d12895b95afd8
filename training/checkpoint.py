"""Checkpoints: written atomically by rank 0, found again on resume.

A checkpoint is a plain dict (model, optimizer, step, config, RNG states).
It is written to a temporary file, fsynced, then renamed into place, so the
last good checkpoint is never overwritten in place; a truncated file is
detected on resume and the previous checkpoint used instead.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def save_checkpoint(folder: Path, step: int, state: dict, keep: int) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in `folder`, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_latest(folder: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; unreadable ones are reported and skipped."""
    for path in list_checkpoints(folder):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - a truncated file: fall back to the one before
            log.warning("checkpoint %s is unreadable (%s); trying the one before it", path, e)
    return None
