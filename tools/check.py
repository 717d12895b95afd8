"""Read every frame of a split and name each utterance with a NaN or Inf value.

    python -m tools.check DATA_DIR [--split train] [--nshard N --rank R]

The trainer never reads the whole corpus at start: it drops a crop with a bad frame when it reads one,
and names the utterance then. Run this before a long job to find every such utterance at once. Rank R of
N checks every N-th utterance starting at R (the trainer's sharding), so the ranks can run on as many
machines as you like. A training run's --output_dir is no store: it is refused, naming the run's --data_dir.
Exit codes: 0 every frame finite; 2 a non-finite utterance found, a missing or unreadable store, or a run's folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
from pathlib import Path

from data.batch_plan import shard_indices
from data.stores import find_split, missing_split, non_finite_utterances
from errors import EXIT_BAD_INPUT, EXIT_OK, BadInputError
from tools.cli import bad_input_exits_2, run
from training.flag_help import FlagHelpFormatter
from training.run_folder import RunFolder

log = logging.getLogger("check")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.check", description=__doc__.split("\n\n")[0],
                                     formatter_class=FlagHelpFormatter)
    parser.add_argument("data_dir", type=Path, help="a fairseq dump or a folder of [T, D] .npy/.pt utterances")
    parser.add_argument("--split", default="train", help="the split to read")
    parser.add_argument("--nshard", type=int, default=1,
                        help="shares the utterances are cut into: --rank R checks every NSHARD-th from R")
    parser.add_argument("--rank", type=int, default=0, help="which share this process checks (0 .. NSHARD-1)")
    args = parser.parse_args(argv)
    if args.nshard < 1 or not 0 <= args.rank < args.nshard:
        parser.error(f"--rank must be in [0, --nshard), got --rank {args.rank} --nshard {args.nshard}")
    return args


@bad_input_exits_2(log)
def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.data_dir.is_dir():
        raise BadInputError(f"{args.data_dir} is not a folder")
    if RunFolder(args.data_dir).holds_a_run():
        raise a_training_run(args.data_dir, args.split)
    store = find_split(args.data_dir, args.split)  # utterance files directly in DATA_DIR: 'train', as trained
    if store is None:
        raise missing_split(args.data_dir, args.split, "--split")
    mine = store.subset(shard_indices(len(store), args.rank, args.nshard), store.description)
    bad = 0
    for i in non_finite_utterances(mine):
        bad += 1
        log.error("non-finite values (NaN or Inf) in %s", mine.name(i))
    log.info("%d of %d utterances (%d frames) checked: %d with non-finite values", len(mine), len(store),
             mine.total_frames, bad)
    if bad:
        log.error("fix or remove the utterance(s) named above; the trainer drops their crops when it reads them")
        return EXIT_BAD_INPUT
    log.info("finished successfully")
    return EXIT_OK


def a_training_run(folder: Path, split: str) -> BadInputError:
    """The error for a trainer's --output_dir given as DATA_DIR, whose checkpoints/ would read as a split of .pt
    utterances: it names the features the run trained on, its config's data_dir."""
    try:
        config = json.loads(RunFolder(folder).config.read_text())
    except (OSError, ValueError):
        config = None
    config = config if isinstance(config, dict) else {}
    said = f"{folder} is a training run (the trainer's --output_dir), not a folder of features"
    if config.get("data_dir"):
        again = ["python", "-m", "tools.check", config["data_dir"], *(["--split", split] if split != "train" else [])]
        return BadInputError(f"{said}: check the features it trained on, its --data_dir: {shlex.join(again)}")
    wanted = "a fairseq dump or a folder of [T, D] .npy/.pt utterances, as tools.extract writes"
    if "data_dir" in config:  # recorded as null: no --data_dir
        return BadInputError(f"{said}; it trained on the built-in demo corpus: give tools.check {wanted}")
    return BadInputError(f"{said}: give tools.check the features it trained on (its --data_dir), {wanted}")


if __name__ == "__main__":
    run(main, "check")
