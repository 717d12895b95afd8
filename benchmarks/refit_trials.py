"""The end-of-schedule codebook refit on trained checkpoints: what it gains on held-out frames, how much that
depends on its random splits, and how far the held-out code usage is what the held-out set's size allows.

For each CHECKPOINT (a trainer checkpoint, or a run folder: its newest checkpoint), with the codec's own beam:
- before the refit: the held-out rel_mse and the residual the codes leave in the latent (`scored`), the
  rel_mse of the first --train_utterances training utterances (the train/held-out gap), and per level the codes
  that win fewer than the refit's RARE_SHARE of the mean share of the training frames' codes (the codes the refit
  splits off populous ones);
- the refit as the trainer runs it (models/codebook_ops.py `refit_codebooks`, --refit_iters Lloyd steps, on the
  utterances rank 0 of a one-rank run reads), once per --seeds (the trainer's is its --seed, 1234): the
  held-out and training rel_mse and the held-out latent residual after it, and per level the held-out usage next
  to the usage a held-out set of that many code frames would show if its frames took the training frames' codes
  at the training frames' frequencies (`expected_usage`): a level under it uses fewer codes on held-out frames
  than on training ones, one at it is as used as sampling that many frames can show.

    python benchmarks/refit_trials.py --data_dir .cache/speech_corpus_seed1 RUN_A RUN_B/checkpoints/step_00001800.pt \\
        --seeds 1234,0,1 --out benchmarks/results/refit_trials_X.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from benchmarks.quality import score  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402
from data.stores import open_stores  # noqa: E402
from errors import Asker, BadInputError  # noqa: E402
from models.codebook_ops import RARE_SHARE  # noqa: E402
from models.codec import RVQCodec  # noqa: E402
from rvq_tokenizer.codec_files import load_codec  # noqa: E402
from training.codebooks import REFIT_SEED_OFFSET, refit_utterances  # noqa: E402
from training.config import parse_args  # noqa: E402

DEFAULTS = parse_args([])
POSITIONAL = Asker(python=False, positional=("checkpoint",))  # a checkpoint is named by its path alone


def expected_usage(counts: np.ndarray, draws: int) -> float:
    """The share of codes that `draws` frames drawn independently at the frequencies `counts` [K] would use at
    least once, on average: the mean over codes of 1 - (1 - p_k)^draws."""
    p = counts / counts.sum()
    return float(np.mean(1.0 - (1.0 - p) ** draws))


def rare_codes(counts: np.ndarray, share: float = RARE_SHARE) -> int:
    """Codes [K] counts that win fewer than `share` of the mean count (none included)."""
    return int((counts < share * counts.mean()).sum())


class FirstUtterances:
    """The first n utterances of a store, scored as quality.score scores a held-out store."""

    def __init__(self, store, n: int):
        self.store, self.n, self.dim = store, min(n, len(store)), store.dim

    def __len__(self):
        return self.n

    def utterance(self, i: int):
        return self.store.utterance(i)

    @property
    def total_frames(self) -> int:
        return int(self.store.lengths[: self.n].sum())


def codes_of(model: RVQCodec, store) -> np.ndarray:
    """[frames, levels] codes of every utterance of `store`, encoded alone with the codec's beam."""
    s, out = model.config.downsample, []
    with torch.no_grad():
        for i in range(len(store)):
            x = torch.from_numpy(np.array(store.utterance(i), dtype=np.float32))
            if len(x) >= s:
                out.append(model.encode(x[: len(x) // s * s]).numpy())
    return np.concatenate(out)


def scored(model: RVQCodec, store) -> dict:
    """quality.py's scores of `store`'s utterances, encoded with the codec's own beam as `score_encoded` encodes
    them, and in the same pass `latent_mse`: the mean squared residual per latent dimension that those codes leave
    in the encoder's output, the quantizer's own error, which the refit lowers (rel_mse is the decoder's output's)."""
    s, residual = model.config.downsample, [0.0, 0]

    def reconstruct(x):
        x = x[: len(x) // s * s]
        codes = model.encode(x)
        latent = model._encode_latent(x[None])[0]
        residual[0] += float(((latent - model.rvq.get_output_from_indices(codes[None])[0]) ** 2).sum())
        residual[1] += latent.numel()
        return model.decode(codes), codes

    with torch.no_grad():
        result = score(store, reconstruct, model.config.num_quantizers, model.config.codebook_size)
    return {**result, "latent_mse": residual[0] / residual[1]}


def level_counts(codes: np.ndarray, size: int) -> list[np.ndarray]:
    return [np.bincount(codes[:, q], minlength=size) for q in range(codes.shape[1])]


def trial(path: Path, train, valid, seeds: list[int], iters: int, refit_frames: int, train_utterances: int,
          usage_utterances: int | None = None) -> dict:
    """usage_utterances: count the training frames' codes (rare codes, the usage they allow) on the first this many
    training utterances (none: every one; each count encodes them all with the beam, long on a large corpus)."""
    model, state, path = load_codec(path, asker=POSITIONAL)
    size = model.config.codebook_size
    seen = FirstUtterances(train, train_utterances)
    counted = train if usage_utterances is None else FirstUtterances(train, usage_utterances)
    before_codes = codes_of(model, counted)
    before = scored(model, valid)
    row = {"checkpoint": str(path), "step": state.get("step"), "codec": state["codec"],
           "before": {"heldout_rel_mse": before["rel_mse"], "heldout_latent_mse": before["latent_mse"],
                      "train_rel_mse": scored(model, seen)["rel_mse"],
                      "rare_codes": [rare_codes(c) for c in level_counts(before_codes, size)]},
           "refits": []}
    utterances = refit_utterances(train, refit_frames, DEFAULTS.optim.seed + REFIT_SEED_OFFSET)
    # the frames of one CPU step: they only scale the EMA statistics the refit leaves, not its codebooks
    batch_frames = DEFAULTS.data.fit_to(train.lengths, model.config.downsample, "cpu").frames_per_step
    for seed in seeds:
        start = time.perf_counter()
        refitted = copy.deepcopy(model)
        with torch.no_grad():
            refitted.refit_codebooks(utterances, iters, batch_frames=batch_frames, seed=seed)
        held_out = scored(refitted, valid)
        code_frames = held_out["frames"] // model.config.downsample  # each utterance's frames: a multiple of it
        trained = level_counts(codes_of(refitted, counted), size)
        row["refits"].append({
            "seed": seed, "heldout_rel_mse": held_out["rel_mse"], "train_rel_mse": scored(refitted, seen)["rel_mse"],
            "heldout_latent_mse": held_out["latent_mse"],
            "heldout_code_frames": code_frames, "heldout_usage": held_out["code_usage"],
            "usage_expected_at_that_size": [round(expected_usage(c, code_frames), 4) for c in trained],
            "train_usage": [round(float((c > 0).mean()), 4) for c in trained],
            "seconds": round(time.perf_counter() - start, 1)})
        r = row["refits"][-1]
        print(f"{path}: seed {seed}: held-out {r['heldout_rel_mse']:.5f} (before the refit "
              f"{row['before']['heldout_rel_mse']:.5f}), train {r['train_rel_mse']:.5f}, held-out latent residual "
              f"{r['heldout_latent_mse']:.5f} (before {row['before']['heldout_latent_mse']:.5f})", file=sys.stderr)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint files or trainer output dirs")
    p.add_argument("--data_dir", default=None, help="the store they trained on (none: the demo corpus)")
    p.add_argument("--seeds", default=str(DEFAULTS.optim.seed), help="comma-separated seeds of the refit's splits")
    p.add_argument("--iters", type=int, default=DEFAULTS.codebooks.refit_iters, help="Lloyd steps per level")
    p.add_argument("--train_utterances", type=int, default=40, help="training utterances scored for the gap")
    p.add_argument("--usage_utterances", type=int, default=None,
                   help="training utterances whose codes are counted (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="JSON path")
    p.add_argument("--trained", default=None, help="how the checkpoints were trained (their commands)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    train, valid, _ = open_stores(args.data_dir or ensure_demo_corpus(), "train", "valid", seed=DEFAULTS.optim.seed)
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        rows = [trial(c, train, valid, seeds, args.iters, DEFAULTS.codebooks.refit_frames, args.train_utterances,
                      args.usage_utterances)
                for c in args.checkpoints]
    except BadInputError as e:  # a path that holds no codec, in load_codec's words
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"data_dir": args.data_dir or "demo corpus", "machine": machine(), "threads": args.threads,
              "command": command_line(), "trained": args.trained,
              "iters": args.iters, "rare_share": RARE_SHARE, "usage_utterances": args.usage_utterances, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
