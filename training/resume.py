"""Resume agreement: rank 0 chooses the checkpoint, every rank loads that one.

Ranks that each picked their own newest file (two nodes with different
`--output_dir`s, or one not on a shared filesystem) would start at different
steps and deadlock in mismatched collectives. So rank 0 alone chooses, as a
single process does (`find_resume`: the newest readable checkpoint, a truncated
one moved aside, or the `--resume` path), and broadcasts the path and step over
the control plane; rank 0 alone renames files, and checks that the checkpoint
trained on this run's data (or that --finetune moves it to other data: sent along
as `new_data`), before it sends its choice. Every
other rank reads that checkpoint where its own flags point (its `--output_dir`'s
checkpoints/, or its `--resume` path) and checks its step;
then one all-gather of each rank's outcome ends every rank at once, with exit 2
and the rank, the path and the cause named, when any of them could not (exit 1,
TransientFault, when the cause was an OS error or exhausted memory while reading:
no file is to blame). When rank 0 has none, every rank starts from step 0.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path


from errors import BadInputError, TransientFault
from models.codec import CodecConfig
from training.checkpoint import RESUME_KEYS, Resume, check_codec, find_resume, list_checkpoints, load_checkpoint
from training.distributed import DistContext, agree, raise_together, rank0_decides

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """What rank 0 broadcasts: the checkpoint it chose (no path: start from step 0), or why it could not choose."""
    path: str | None = None
    step: int | None = None
    error: str | None = None
    transient: bool = False  # the error is a TransientFault (exit 1), not bad input (exit 2)
    new_data: bool = False  # --finetune on other data than the checkpoint's


def agree_on_resume(ctx: DistContext, resume: str, folder: Path, codec: CodecConfig, data: dict | None = None,
                    finetune: bool = False) -> Resume | None:
    """The checkpoint every rank continues from, chosen by rank 0 (--resume auto, none, or a path), trained on
    `data` (their identity; other data only with `finetune`): rank 0 alone compares them.
    Raises BadInputError on every rank together when rank 0 could not choose or any rank cannot read the choice."""
    if not ctx.is_distributed:
        return find_resume(resume, folder, codec, data, finetune)
    mine, choice = _choose(ctx, resume, folder, codec, data, finetune)
    raise_together(ctx, choice.error, TransientFault if choice.transient else BadInputError)
    if choice.path is None:
        if ctx.rank != 0 and resume == "auto":
            _warn_of_ignored_checkpoints(ctx.rank, folder)
        return None
    error = None  # (message, transient)
    if ctx.rank != 0:
        path = folder / Path(choice.path).name if resume == "auto" else Path(resume)
        try:
            mine = _read_chosen(path, choice.step, codec, choice.new_data)
        except TransientFault as e:
            error = (f"rank {ctx.rank}: {e}", True)
        except Exception as e:  # noqa: BLE001 - any failure must reach the all-gather, or the others would wait
            where = "--output_dir" if resume == "auto" else "--resume"
            error = (f"rank {ctx.rank} cannot read checkpoint {path} chosen by rank 0 ({choice.path}, step "
                     f"{choice.step}): {e}. {where} must be on a filesystem every node sees", False)
    failed = [outcome for outcome in agree(ctx, error) if outcome]
    if failed:
        failure = TransientFault if any(transient for _, transient in failed) else BadInputError
        raise failure("; ".join(message for message, _ in failed))
    return mine


def _choose(ctx: DistContext, resume: str, folder: Path, codec: CodecConfig, data: dict | None,
            finetune: bool) -> tuple[Resume | None, Choice]:
    """Rank 0's choice, on every rank; rank 0 also returns the checkpoint it loaded to choose it."""
    mine, choice = None, Choice()
    if ctx.rank == 0:
        try:
            mine = find_resume(resume, folder, codec, data, finetune)
        except (BadInputError, TransientFault) as e:
            choice = Choice(error=str(e), transient=isinstance(e, TransientFault))
        if mine is not None:
            choice = Choice(path=str(mine.path.absolute()), step=mine.state["step"], new_data=mine.new_data)
    return mine, rank0_decides(ctx, choice)


def _read_chosen(path: Path, step: int, codec: CodecConfig, new_data: bool) -> Resume:
    state = load_checkpoint(path, RESUME_KEYS)
    if state["step"] != step:
        raise ValueError(f"it holds step {state['step']}: another run's checkpoint")
    check_codec(path, state, codec)
    return Resume(path, state, new_data)


def _warn_of_ignored_checkpoints(rank: int, folder: Path) -> None:
    """Checkpoints this rank sees but rank 0 does not: only rank 0's --output_dir counts."""
    found = list_checkpoints(folder)
    if found:
        log.warning("rank %d: rank 0 found no checkpoint to resume from, so every rank starts at step 0; the %d "
                    "checkpoint(s) in %s (newest %s) are ignored. Only rank 0's --output_dir counts: it must be on "
                    "a filesystem every node sees", rank, len(found), folder, found[0].name)
