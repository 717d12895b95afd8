"""Checkpoints: what one holds, written atomically by rank 0, found again and restored on resume.

A checkpoint is a plain dict: model, optimizer, grad scaler, step, samples seen,
epoch, the codec's config, every flag, every rank's RNG states, and the training data's identity (`data`,
with `data_history` once --finetune moved it to other data: a resume on other data is refused). `Checkpointer`
is the one place that decides that content, both ways. A file is written to a
temporary name, fsynced, then renamed into place, so the last good checkpoint is
never overwritten in place, and a write that fails removes its temporary file.
Only a file proven malformed (not a zip, a bad pickle, truncated, or a torch
file without a checkpoint's content) is moved aside on resume (NAME.pt.unreadable)
and the previous checkpoint used instead; an OS error or exhausted memory while
reading says nothing about the file: it ends the run (TransientFault, exit 1) and
every file is kept. Which checkpoint every rank resumes from is rank 0's choice
(training/resume.py).
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from errors import BadInputError, TransientFault
from models.codec import CodecConfig
from training.distributed import DistContext, agree, raise_together, rank0_decides
from training.progress import END_OF_SCHEDULE, Progress

log = logging.getLogger(__name__)

NAME = re.compile(r"^step_(\d{8})\.pt$")
UNREADABLE = ".unreadable"  # the suffix of a checkpoint moved aside on resume: no longer NAME, so never listed


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def save_checkpoint(folder: Path, step: int, state: dict, keep: int) -> Path:
    """Written to NAME.pt.tmp, fsynced and renamed into place; a write that fails (disk full, an I/O error)
    removes the temporary file and raises TransientFault, leaving the checkpoints as they were."""
    folder = Path(folder)
    final = checkpoint_path(folder, step)
    tmp = final.with_name(final.name + ".tmp")
    # serialised in memory first: the file's write error (ENOSPC) then comes from this write as an OSError, never
    # from inside torch's zip writer, which replaces it with a RuntimeError ("unexpected pos")
    data = io.BytesIO()
    torch.save(state, data)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TransientFault(f"writing checkpoint {final} failed: {e}; the newest checkpoint is the one "
                             "before it") from e
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


# What every reader of a checkpoint needs (tools.encode, tools.export), and what a resume needs too
CHECKPOINT_KEYS = ("model", "codec", "step")
RESUME_KEYS = (*CHECKPOINT_KEYS, "optimizer", "samples_seen", "rng")
# An error that the path causes, not the file nor the machine: the caller names the path
WRONG_PATH = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


class Malformed(Exception):
    """A file proven not to be a checkpoint: not a zip, a bad pickle, truncated, or without a checkpoint's content.
    Its text is the reason, in a few words."""


def load_checkpoint(path: Path, needs: tuple = CHECKPOINT_KEYS) -> dict:
    """The checkpoint's dict. Raises Malformed for a file that is not a checkpoint with the entries `needs`;
    TransientFault for an OS error or exhausted memory while reading it (which proves nothing about the file);
    a WRONG_PATH error as it is."""
    path = Path(path)
    try:
        # read whole first: an I/O error then comes from this read, never from inside torch's zip reader, where
        # it would look like a damaged file
        data = path.read_bytes()
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except WRONG_PATH:
        raise
    except (OSError, MemoryError, torch.OutOfMemoryError) as e:
        raise TransientFault(f"reading checkpoint {path} failed ({type(e).__name__}: {e}); every checkpoint is "
                             "kept as it is: run again once the filesystem or memory has recovered") from e
    except Exception as e:  # noqa: BLE001 - any other error is the parser's: the bytes are not a checkpoint
        raise Malformed(unreadable_reason(path, e)) from e
    missing = [key for key in needs if not isinstance(state, dict) or key not in state]
    if missing or not (isinstance(state["model"], dict) and isinstance(state["codec"], dict)
                       and isinstance(state["step"], int)):
        raise Malformed(f"a torch file without a checkpoint's content (no {', '.join(map(repr, missing))})"
                        if missing else "a torch file whose model, codec or step entries are not a checkpoint's")
    return state


def load_latest(folder: Path, *, set_aside: bool = False, needs: tuple = CHECKPOINT_KEYS) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; malformed ones are reported and skipped. With set_aside (resuming, on
    rank 0, the one process that writes checkpoints/) each is also renamed NAME.pt.unreadable, so that it neither
    counts among the --keep_checkpoints, where it would sort newer and push the run's new checkpoints out, nor is
    overwritten by a new checkpoint of its step. Nothing is deleted. An OS error or exhausted memory while reading
    raises TransientFault: a good checkpoint must not be set aside for it."""
    for path in list_checkpoints(folder):
        try:
            return path, load_checkpoint(path, needs)
        except Malformed as e:
            reason = str(e)
        except FileNotFoundError:  # gone since the listing
            continue
        except WRONG_PATH as e:
            raise BadInputError(f"checkpoint {path} cannot be read ({e.strerror}): --output_dir must be readable "
                                "and writable") from e
        if not set_aside:
            log.warning("checkpoint %s is unreadable (%s); trying the one before it", path, reason)
            continue
        aside = path.with_name(path.name + UNREADABLE)
        try:
            os.replace(path, aside)
        except OSError as e:
            raise BadInputError(f"checkpoint {path} is unreadable ({reason}) and cannot be moved aside ({e}): "
                                f"--output_dir must be writable") from e
        log.warning("checkpoint %s is unreadable (%s); moved aside to %s, trying the one before it", path, reason,
                    aside.name)
    return None


def unreadable_reason(path: Path, error: Exception) -> str:
    """Why a checkpoint did not load, in a few words: an empty file, else the error's type and first line."""
    if isinstance(error, Malformed):
        return str(error)
    try:
        if path.stat().st_size == 0:
            return "empty file"
    except OSError:
        pass
    if isinstance(error, pickle.UnpicklingError):  # torch's text here suggests weights_only=False: not ours to say
        return "not a torch checkpoint, or one holding objects other than tensors and plain values"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass
class Resume:
    """The checkpoint a run continues from, as training/resume.py chose it and read it through this module."""

    path: Path
    state: dict
    new_data: bool = False  # --finetune on other data than the checkpoint's: the feature statistics are redone


class Checkpointer:
    """Saves and restores a run: model, optimizer, scaler, progress and RNG states (every rank's), and the data
    it trains on (`data`: their identity, data/training_data.py; with the codec's feature statistics)."""

    def __init__(self, folder: Path, *, keep: int, ctx: DistContext, codec: CodecConfig, config: dict,
                 steps_per_epoch: int, data: dict | None = None):
        self.folder, self.keep, self.ctx = Path(folder), keep, ctx
        self.codec, self.config, self.steps_per_epoch, self.data = codec, config, steps_per_epoch, data
        self.data_history: list[dict] = []  # {"step", "data"}: what the run trained on before each --finetune
        self.last_eval: dict | None = None  # {"step", "rel_mse", "final"} of the last eval: the tools describe it

    def save(self, model, optimizer, scaler, progress: Progress, before_write=None) -> Path | None:
        """Every rank calls it (the RNG states are gathered); rank 0 writes while the others wait for it on the
        control plane, so that the wait runs under the caller's slow-phase timeout rather than in the next
        step's collective. Returns the path on rank 0. A write that failed raises TransientFault on every rank
        (rank 0 sends the outcome), the previous checkpoint still the newest. before_write(step) runs on rank 0
        first (fault injection)."""
        rng = gather_rng_states(self.ctx)
        path, error = None, None
        if self.ctx.rank == 0:
            if before_write is not None:
                before_write(progress.step)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "step": progress.step, "samples_seen": progress.samples_seen,
                     "schedule_fraction": progress.schedule_fraction, "time_spent": progress.time_spent,
                     "seconds_per_frame": progress.seconds_per_frame,
                     # what a resumed CPU run computes with (training/threads.py): other counts round sums otherwise
                     "threads": torch.get_num_threads() if self.ctx.device.type == "cpu" else None,
                     "epoch": progress.step // self.steps_per_epoch, "codec": self.codec.to_dict(),
                     "config": self.config, "rng": rng, "end_of_schedule": list(progress.end_of_schedule),
                     "data": {**self.data, "stats": feature_stats_record(model)} if self.data else None,
                     "data_history": self.data_history, "eval": self.last_eval}
            try:
                path = save_checkpoint(self.folder, progress.step, state, keep=self.keep)
            except TransientFault as e:
                error = str(e)
        raise_together(self.ctx, rank0_decides(self.ctx, error), TransientFault)
        return path

    def restore(self, resume: Resume, model, optimizer, scaler, progress: Progress) -> None:
        state = resume.state
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_scaler(scaler, state.get("scaler") or {})
        progress.step, progress.samples_seen = state["step"], state["samples_seen"]
        progress.schedule_fraction = state.get("schedule_fraction", 0.0)
        progress.time_spent = time_spent(state)
        progress.seconds_per_frame = state.get("seconds_per_frame")
        # a checkpoint from before this entry was saved after the end-of-schedule work, if any was due
        progress.end_of_schedule = list(state.get("end_of_schedule", END_OF_SCHEDULE))
        restore_rng_states(state["rng"], self.ctx)
        self.data_history = list(state.get("data_history") or [])
        self.last_eval = None if resume.new_data else state.get("eval")  # an eval on other data says nothing now
        if resume.new_data:  # --finetune: the record says on what, and from which step, it trained before
            self.data_history.append({"step": state["step"], "data": state.get("data")})
        log.info("resumed from %s at step %d", resume.path, progress.step)


def time_spent(state: dict) -> float:
    """The seconds of --max_minutes a checkpoint's run spent. One from before the record counts its whole budget
    if it trained under --max_minutes alone and its learning rate had finished the decay (the clock ended its
    schedule); else none is known, and it resumes with a whole budget, as it did."""
    if "time_spent" in state:
        return state["time_spent"]
    config = state.get("config") or {}
    minutes = config.get("max_minutes")
    ended = state.get("schedule_fraction", 0.0) >= 1 - 1e-9 and not config.get("max_steps") and not config.get("epochs")
    return 60.0 * minutes if minutes and ended else 0.0


def feature_stats_record(model) -> dict:
    """The codec's feature statistics in brief (the mean over dimensions of its per-dimension mean and std; the
    whole vectors are the model's feature_mean and feature_std)."""
    return {"mean": float(model.feature_mean.float().mean()), "std": float(model.feature_std.float().mean())}


def gather_rng_states(ctx: DistContext) -> list:
    """Every rank's RNG states, so that a resumed run draws what an unbroken one would have."""
    mine = {"torch": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return agree(ctx, mine)


def restore_rng_states(states: list, ctx: DistContext) -> None:
    if len(states) != ctx.world_size:
        log.warning("checkpoint has RNG states for %d ranks, this run has %d: reseeding", len(states), ctx.world_size)
        return
    torch.set_rng_state(states[ctx.rank]["torch"])
    if ctx.device.type == "cuda" and "cuda" in states[ctx.rank]:
        torch.cuda.set_rng_state(states[ctx.rank]["cuda"], ctx.device)


def restore_scaler(scaler, saved: dict) -> None:
    """The fp16 grad scaler's state, across a change of --precision: a bf16 or fp32 run saves an
    empty state (its scaler is disabled), which an fp16 run replaces by a fresh scaler's; an fp16
    run's state is dropped by a disabled scaler."""
    if scaler.is_enabled() and saved:
        scaler.load_state_dict(saved)
