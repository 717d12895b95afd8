"""Which checkpoint a run continues from, and every rank's agreement on it.

`find_resume` is the choice: --resume auto (the newest readable checkpoint in --output_dir, a truncated one moved
aside), none, or a path; the checkpoint must have trained this run's codec on this run's data (`check_codec`,
`check_data`; other data only with --finetune), and a run may not start behind checkpoints already in its folder.
training/checkpoint.py reads and writes the files; this module decides.

Ranks that each picked their own newest file (two nodes with different
`--output_dir`s, or one not on a shared filesystem) would start at different
steps and deadlock in mismatched collectives. So rank 0 alone chooses, as a
single process does, and broadcasts the path and step over
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

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path


from data.setting_changes import changes
from data.training_data import data_differences
from errors import BadInputError, TransientFault
from models.codec import CodecConfig
from training.checkpoint import (NAME, RESUME_KEYS, WRONG_PATH, Malformed, Resume, list_checkpoints,
                                 load_checkpoint, load_latest, unreadable_reason)
from training.distributed import DistContext, agree, raise_together, rank0_decides

log = logging.getLogger(__name__)


def find_resume(resume: str, folder: Path, codec: CodecConfig, data: dict | None = None,
                finetune: bool = False) -> Resume | None:
    """The checkpoint to continue from (--resume auto, none, or a path), trained with this run's codec on this
    run's data (`data`: its identity, data/training_data.py; other data only with `finetune`).
    On several ranks, rank 0 alone calls it (it moves unreadable checkpoints aside) and the others load its
    choice (training/resume.py). A run that would start behind checkpoints already in `folder` (--resume none
    there, or an older --resume path) is refused: its own checkpoints would be the oldest, pruned first."""
    found = None
    if resume == "auto":
        found = load_latest(folder, set_aside=True, needs=RESUME_KEYS)
    elif resume != "none":
        try:
            found = Path(resume), load_checkpoint(Path(resume), RESUME_KEYS)
        except (Malformed, *WRONG_PATH) as e:  # missing, truncated or not a checkpoint: the flag is wrong
            raise BadInputError(f"--resume {resume}: cannot read it: {unreadable_reason(Path(resume), e)}") from e
    start = found[1]["step"] if found is not None else 0
    ahead = [p for p in list_checkpoints(folder) if int(NAME.match(p.name).group(1)) > start]
    if ahead:
        raise BadInputError(
            f"{folder} holds checkpoints of another run, up to {ahead[0].name}, ahead of step {start} where this "
            f"run starts (--resume {resume}): they would outlive this run's own under --keep_checkpoints, and "
            "--resume auto would later pick them. Use another --output_dir, move them away, or --resume auto to "
            "continue that run")
    if found is None:
        return None
    path, state = found
    new_data = check_data(path, state, data, finetune, resume)
    check_codec(path, state, codec, resume)
    return Resume(path, state, new_data)


def check_data(path: Path, state: dict, data: dict | None, finetune: bool, resume: str = "auto") -> bool:
    """Whether the run goes on with other data than the checkpoint trained on: only under --finetune; without it
    a BadInputError names what differs. A checkpoint from before the record (no "data") is not checked."""
    trained = state.get("data")
    if data is None or trained is None:
        if data is not None:
            log.warning("checkpoint %s predates the record of its training data: --data_dir is not checked", path)
        return False
    differ = data_differences(trained, data)
    if not differ:
        if finetune:
            log.info("--finetune: these are the data checkpoint %s trained on; it resumes as it is", path)
        return False
    if finetune and trained.get("dim") == data.get("dim"):
        log.warning("--finetune: checkpoint %s (step %d) goes on with other data (%s); the feature statistics are "
                    "these data's", path, state["step"], "; ".join(differ))
        return True
    split = trained.get("store", {}).get("split")
    again = ("no --data_dir (the demo corpus)" if trained.get("features", {}).get("feature") == "demo"
             else f"--data_dir {trained.get('data_dir')}")
    again += f" --train_split {split}" if split != data["store"]["split"] else ""
    fresh = "another --output_dir" if resume == "auto" else "no --resume"
    tune = ("to fine-tune it on these data, add --finetune" if trained.get("dim") == data.get("dim")
            else f"a codec of {trained.get('dim')}-d features fine-tunes on no other width")
    raise BadInputError(f"checkpoint {path} (step {state['step']}) was trained on other data than this run's "
                        f"({'; '.join(differ)}). To continue it, give {again}; {tune}; to train afresh on them, "
                        f"give {fresh}")


def check_codec(path: Path, state: dict, codec: CodecConfig, resume: str = "auto") -> None:
    """A checkpoint resumes only into the codec it trained; a field it predates counts at its default. The
    refusal names the fields that differ and the flags that give the checkpoint's codec back."""
    from training.config import command_line  # the config imports the data, which import nothing of training/

    saved = {f.name: f.default for f in dataclasses.fields(CodecConfig) if f.default is not dataclasses.MISSING}
    saved.update(state["codec"])
    now = codec.to_dict()
    differ = [key for key in now if saved.get(key) != now[key]]
    if not differ:
        return
    flags = {f.name for f in dataclasses.fields(CodecConfig) if f.metadata.get("flag", True)} - {"feature_dim"}
    given = command_line({key: saved[key] for key in differ if key in flags})  # the flags not at their default
    left_out = [f"--{key}" for key in differ if key in flags and f"--{key}" not in given]
    fix = " and ".join(([f"with {' '.join(given)}"] if given else [])
                       + ([f"without {', '.join(left_out)}"] if left_out else []))
    fresh = "give another --output_dir" if resume == "auto" else "give no --resume"
    raise BadInputError(f"checkpoint {path} was trained with a codec that differs from this run's flags: "
                        + ", ".join(changes(saved, now, differ,
                                            word=lambda key, was, ours: f"{key} {was} (this run: {ours})"))
                        + (f". To continue it, run {fix}" if fix else "")
                        + f"; to train this codec from scratch, {fresh}")


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
