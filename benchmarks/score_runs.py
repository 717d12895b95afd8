"""Score finished trainer runs as benchmarks/quality.py scores its codec: side-by-side trials of the trainer's flags.

Each RUN is a trainer --output_dir; its last checkpoint is encoded as tools.encode writes codes (the codec's own
beam) and scored on every frame of the held-out utterances of --data_dir (quality.py score_encoded). A run's row
names the flags in which its config.json differs from the trainer's defaults (output_dir, data_dir and threads
aside), its steps and its time from the first metrics event to the stop. A run trained with `--max_steps N` and
the same flags gives the same codes whatever else runs beside it, so trials can share the cores:

    python rvq_seamless_gpu_cache_nccl.py --data_dir .cache/speech_corpus --output_dir /tmp/trials/lr4 \\
        --resume none --max_minutes 60 --max_steps 2000 --threads 1 --downsample 2 --lr 4e-3 &
    python rvq_seamless_gpu_cache_nccl.py ... --output_dir /tmp/trials/base ... --downsample 2 &
    wait
    python benchmarks/score_runs.py --data_dir .cache/speech_corpus /tmp/trials/base /tmp/trials/lr4 --out x.json

The row of a run is what `quality.py --methods codec --max_minutes 60 -- FLAGS` gives for the same flags. With
`--kbps`, a run has a row for each rung its first levels make, scored as rate_ladder.py scores a codec of the ladder
(the lowest level's usage on the held-out code frames beside its ceiling, and on the training frames; level 1's PNMI
with `--alignments`); `--valid_dir` scores on another store's held-out split, e.g. one ten times as large.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from benchmarks.quality import finished_run, score_encoded  # noqa: E402
from benchmarks.rate_ladder import phone_labels, rungs, score_codec  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402
from data.stores import open_stores  # noqa: E402
from training.config import parse_args  # noqa: E402
from training.run_folder import RunFolder  # noqa: E402

NOT_TRIAL_FLAGS = {"output_dir", "data_dir", "threads", "resume", "max_minutes", "nccl_timeout"}
EDGE_BANDS = (0, 8, 16, 32, 64)  # --by_edge: frames from the utterance's nearer end, [0, 8) ... [64, its middle]


def changed_flags(config: dict) -> dict:
    """The flags of a run's config.json whose values differ from the trainer's defaults."""
    defaults = parse_args([]).to_dict()
    return {k: v for k, v in config.items() if k not in NOT_TRIAL_FLAGS and k in defaults and defaults[k] != v}


class EdgeErrors:
    """The held-out error by a frame's distance from its utterance's nearer end, in EDGE_BANDS (--by_edge): `add`
    is quality.score's `each`. A band's rel_mse is its frames' squared error over the variance of all held-out
    frames, rel_mse's denominator: the bands' rel_mse weighted by their shares is the whole rel_mse."""

    def __init__(self):
        self.errors, self.distances = [], []

    def add(self, x: torch.Tensor, x_hat: torch.Tensor) -> None:
        self.errors.append(((x_hat.double() - x.double()) ** 2).sum(1).numpy())
        t = np.arange(len(x))
        self.distances.append(np.minimum(t, len(x) - 1 - t))

    def bands(self, rel_mse: float) -> list[dict]:
        error, distance = np.concatenate(self.errors), np.concatenate(self.distances)
        error = error * rel_mse / error.mean()  # a frame's error over the mean variance of a frame
        bands = []
        for low, high in zip(EDGE_BANDS, [*EDGE_BANDS[1:], None]):
            inside = (distance >= low) & (True if high is None else distance < high)
            bands.append({"from_end": f"{low}-{high}" if high else f"{low}+",
                          "share": round(float(inside.mean()), 4), "rel_mse": float(error[inside].mean())})
        return bands


def trained_run(run: Path) -> tuple[dict, object]:
    """A finished run's row heading (its name, the flags it changed, its steps, stop and time) and its codec."""
    config = json.loads((RunFolder(run).root / "config.json").read_text())
    stop, seconds, _, model = finished_run(run)
    return {"run": run.name, "flags": changed_flags(config), "steps": stop["step"], "stop_reason": stop["reason"],
            "train_seconds": round(seconds, 1)}, model


def score_run(run: Path, valid, by_edge: bool = False) -> dict:
    heading, model = trained_run(run)
    edges = EdgeErrors() if by_edge else None
    row = score_encoded(model, valid, model.config.beam_size, {}, edges.add if by_edge else None)
    result = {**heading, "rel_mse": row["rel_mse"], "lowest_usage": min(row["code_usage"]), "frames": row["frames"]}
    if by_edge:
        result["by_edge"] = edges.bands(row["rel_mse"])
    return result


def score_rungs(run: Path, train, valid, kbps: tuple[float, ...], labels) -> list[dict]:
    """A run's rows at each rung of `kbps` its first levels make (rate_ladder.py score_codec)."""
    heading, model = trained_run(run)
    c = model.config
    ladder = rungs(c.num_quantizers, c.codebook_size, c.downsample, kbps)
    return [{**heading, **row} for row in score_codec(model, valid, ladder, labels, train)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="trainer output dirs")
    p.add_argument("--data_dir", default=None, help="the store the runs trained on (none: the demo corpus)")
    p.add_argument("--by_edge", action="store_true", help="also the error by distance from the utterance's ends")
    p.add_argument("--valid_dir", default=None, help="score on this store's held-out split instead of --data_dir's")
    p.add_argument("--kbps", default=None,
                   help="comma-separated rungs (kilobits per second): a row for each rung a run's first levels make")
    p.add_argument("--alignments", type=Path, default=None,
                   help="the held-out split's frame labels (.phn), for level 1's PNMI (with --kbps)")
    p.add_argument("--out", type=Path, required=True, help="JSON path")
    p.add_argument("--trained", default=None, help="how the runs were trained (their commands), for the report")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.alignments and not args.kbps:
        p.error("--alignments needs --kbps")
    if args.by_edge and args.kbps:
        p.error("--by_edge scores the whole codec: leave out --kbps")
    seed = parse_args([]).optim.seed
    train, valid, _ = open_stores(args.data_dir or ensure_demo_corpus(), "train", "valid", seed=seed)
    if args.valid_dir:
        _, valid, _ = open_stores(args.valid_dir, "train", "valid", seed=seed)
    labels = phone_labels(args.alignments, valid)
    kbps = tuple(float(k) for k in args.kbps.split(",")) if args.kbps else ()
    rows = []
    for run in args.runs:
        if kbps:
            new = score_rungs(run, train, valid, kbps, labels)
        else:
            new = [score_run(run, valid, args.by_edge)]
        for row in new:
            rung = f"{row['kbps']:g} kbps, " if "kbps" in row else ""
            print(f"{run.name}: {row['steps']} steps, {rung}rel_mse {row['rel_mse']:.5f}, lowest usage "
                  f"{row['lowest_usage']:.1%}, flags {row['flags']}", file=sys.stderr)
        rows += new
    report = {"data_dir": args.data_dir or "demo corpus", "valid_dir": args.valid_dir or args.data_dir or "demo corpus",
              "valid_frames": int(valid.total_frames), "machine": machine(),
              "command": command_line(), "trained": args.trained,
              "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
