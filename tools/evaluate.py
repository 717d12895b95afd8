"""How good a trained codec is, on whole utterances of a split, with the codes tools.encode writes.

    python -m tools.evaluate --checkpoint RUN --data_dir FEATS --split valid
    python -m tools.evaluate --checkpoint RUN --data_dir FEATS --split valid --alignments valid.phn \\
        --baseline kmeans --json eval.json

Every utterance of the split is encoded as tools.encode encodes it (training/codec_passes.py encode_in_batches: the same
beam, the same length-sorted batches, the same codes bit for bit) and decoded as `tools.encode decode` does, then
scored as the trainer's final eval scores (training/evaluate.py add_whole_utterance, models/metrics.py EvalSums):
rel_mse, cosine, bits per frame, and per level the share of its codes used and their perplexity. An utterance
with a NaN or Inf frame is left out (named and counted), as the final eval leaves it out. The split's codes are
held in memory ([code frames, levels] integers): meant for a held-out split.

--alignments PATH adds, per level and for the first k levels together, PNMI, phone purity and cluster purity
against phone labels (models/unit_quality.py: as fairseq's measure_teacher_quality.py defines them). The formats
(data/alignments.py): a .phn file of frame labels (one line per utterance in the split's order, one label per
feature frame), a folder of TextGrid files with a "phones" tier (the Montreal Forced Aligner's), or a .ctm file;
TextGrid and CTM are matched by utterance name (the audio file's stem, from the dump's .tsv manifests) and
converted to frames at the features' frame rate (the dump's frame_rate_hz, else 50 Hz) by each frame's centre.
Labels are scored at the code rate: code frame j takes the label of its first feature frame, j x downsample.
Levels 1..k whose units have fewer than FRAMES_PER_UNIT code frames each are warned about (warn_of_joint_units).

--baseline kmeans fits plain k-means with as many clusters as a level has codes on a seeded sample of at most
KMEANS_FRAMES feature frames of --baseline_split (whole utterances in a random order), k-means++ then
KMEANS_ITERS Lloyd iterations (models/kmeans.py), on the raw feature frames (as fairseq's simple_kmeans fits
HuBERT's units; the codec sees standardised frames through its encoder), and scores each held-out feature frame's
nearest centroid the same way: its units mapped to code frames as the labels are, its rel_mse that of the
centroids as a reconstruction. The centroids are cached (fit_baseline), keyed on everything they depend on.
The features are checked as tools.encode checks them, and how they passed is said (`feature_check`).

The table goes to stdout; --json OUT writes the same figures as one JSON object. Exit codes: 0 done, 2 bad
arguments or data (a bad alignment names the first bad utterance; nothing is written), 1 anything else.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.alignments import Alignments, labels_at_code_rate, read_alignments, utterance_names
from data.audio.features import FRAME_RATE
from data.dump_writer import cache_folder, write_temporary
from data.feature_settings import dump_feature_settings
from data.stores import FeatureStore, find_split, missing_split
from errors import EXIT_OK, BadInputError
from models.codes import code_frames
from models.kmeans import KMEANS_ITERS, fit_kmeans, nearest_centroids
from models.metrics import EvalSums
from models.unit_quality import phone_information, unit_quality
from rvq_tokenizer.codec_files import open_codec
from rvq_tokenizer.codes_spec import CodesRequest, CodesSpec, codes_spec, describe_codes
from rvq_tokenizer.feature_check import SplitShare, check_features, open_share
from tools.cli import bad_input_exits_2, run
from tools.codes_flags import add_checkpoint_arg, add_codes_args, codes_request
from training.codebooks import refit_utterances
from training.codec_passes import encode_in_batches
from training.device import select_device
from training.evaluate import add_whole_utterance
from training.flag_help import FlagHelpFormatter
from training.threads import set_cpu_threads

log = logging.getLogger("evaluate")

KMEANS_FRAMES = 100_000  # training frames the k-means baseline is fitted on, at most
PHONE_KEYS = ("pnmi", "phone_purity", "cluster_purity")
# levels 1..k whose units have fewer code frames each than this: their joint PNMI and phone purity near 1 say how
# few frames each unit has (a unit seen once predicts its one phone), not what the units carry
FRAMES_PER_UNIT = 2
KMEANS_CACHE = "kmeans_baseline"  # the fitted baselines' folder in data/dump_writer.py cache_folder()


@dataclass(frozen=True)
class KmeansBaseline:
    """Plain k-means of the codebook size, fitted on a split of the same store (--baseline_split), seeded."""

    split: str
    seed: int


@dataclass(frozen=True)
class EvaluateSettings:
    """What tools.evaluate's flags ask for."""

    checkpoint: Path  # a checkpoint file or a run's --output_dir
    data: SplitShare  # the split scored, whole
    codes: CodesRequest
    alignments: Path | None
    baseline: KmeansBaseline | None
    json: Path | None
    allow_feature_mismatch: bool
    device: str


def open_baseline_split(data_dir: Path, name: str, dim: int) -> FeatureStore:
    split = find_split(data_dir, name)
    if split is None:
        raise missing_split(data_dir, name, "--baseline_split")
    if split.dim != dim:
        raise BadInputError(f"{split.description} has {split.dim}-d features; the evaluated split has {dim}-d")
    return split


def kmeans_sample(store: FeatureStore, size: int, seed: int) -> torch.Tensor:
    """At most KMEANS_FRAMES frames of whole utterances of `store` in a seeded random order (finite ones only);
    BadInputError when they are fewer than the `size` clusters."""
    utterances = refit_utterances(store, KMEANS_FRAMES, seed)
    sample = torch.cat(utterances)[:KMEANS_FRAMES] if utterances else torch.zeros(0, store.dim)
    if len(sample) < size:
        raise BadInputError(f"{store.description} has {len(sample)} finite frames: too few for a k-means of {size} "
                            "clusters (the codec's codebook size); give another --baseline_split")
    return sample


def fit_baseline(sample: torch.Tensor, size: int, seed: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """(k-means centroids of `sample`, where they come from): read from the cache when this sample, cluster count,
    seed, iterations, kind of device and torch version were fitted before (each file is named by a digest of
    them all), else fitted and cached."""
    digest = hashlib.sha256(sample.contiguous().numpy().tobytes())
    digest.update(f"{tuple(sample.shape)} {size} {seed} {KMEANS_ITERS} {device.type} {torch.__version__}".encode())
    path = cache_folder() / KMEANS_CACHE / f"{digest.hexdigest()[:32]}.pt"
    try:
        return torch.load(path, map_location=device, weights_only=True), f"read from the cache, {path}"
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a damaged cache file is fitted again, and replaced
        log.warning("k-means baseline: %s cannot be read (%s): fitting it again", path, e)
    with tqdm(total=KMEANS_ITERS + 1, desc="k-means", unit="iter", dynamic_ncols=True, mininterval=1.0) as bar:
        centroids = fit_kmeans(sample.to(device), size, seed=seed, on_iteration=lambda: bar.update(1))
    data, tmp = io.BytesIO(), path.with_name(path.name + ".tmp")
    torch.save(centroids.cpu(), data)  # in memory: a full disk then fails in our write, as an OSError
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data.getbuffer())
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full home: the next call fits again
        tmp.unlink(missing_ok=True)
        log.warning("k-means baseline: could not be cached in %s (%s)", path, e)
        return centroids, "fitted"
    return centroids, f"fitted, cached in {path}"


def warn_of_joint_units(levels: list[dict], code_frames: int) -> None:
    """A warning when levels 1..k form units of fewer than FRAMES_PER_UNIT code frames each: their joint PNMI and
    purities then count frames, not phone information."""
    thin = next((entry for entry in levels if entry["joint_units"] * FRAMES_PER_UNIT > code_frames), None)
    if thin is not None:
        k = thin["level"]
        log.warning("levels 1..%d form %d units over %d code frames (%.1f frames a unit; fewer than %d from level %d "
                    "on): their joint PNMI (%s) and phone purity come near 1 because nearly every unit is seen once "
                    "and predicts its one phone, whatever the units carry. Read those levels alone, or score more "
                    "frames", k, thin["joint_units"], code_frames, code_frames / thin["joint_units"], FRAMES_PER_UNIT,
                    k, number(thin["joint_pnmi"]))


def encode_split(spec: CodesSpec, store: FeatureStore) -> np.ndarray:
    """The split's codes as tools.encode writes them, with a bar."""
    with tqdm(total=store.total_frames, desc=f"encode {store.description}", unit="frame", unit_scale=True,
              dynamic_ncols=True, mininterval=1.0) as bar:
        return encode_in_batches(spec.model, store, spec.levels, spec.batch_frames, spec.dtype, spec.beam,
                                 on_batch=lambda batch: bar.update(int(store.lengths[batch].sum())))


def score(data: SplitShare, spec: CodesSpec, store: FeatureStore, codes: np.ndarray, alignments: Alignments | None,
          centroids: torch.Tensor | None, fitted: dict | None, device: torch.device) -> dict:
    """Every figure of the printout and the JSON; `fitted`: how the k-means baseline's `centroids` were fitted."""
    config = spec.model.config
    s = config.downsample
    lengths = code_frames(store.lengths, s)
    starts = np.cumsum(lengths) - lengths
    sums = EvalSums(config.feature_dim, spec.levels, config.codebook_size, device)
    baseline = EvalSums(config.feature_dim, 1, config.codebook_size, device) if centroids is not None else None
    phones, scored_codes, units, skipped = [], [], [], []
    for i in tqdm(range(len(store)), desc="score", unit="utt", dynamic_ncols=True, mininterval=1.0):
        features = np.array(store.utterance(i), dtype=np.float32)  # a copy: a store's arrays are read-only
        if not len(features) or not np.isfinite(features).all():
            skipped.append(i)
            continue
        mine = codes[starts[i] : starts[i] + lengths[i]]
        add_whole_utterance(sums, spec.model, features, mine, device)
        if alignments is not None:
            phones.append(labels_at_code_rate(alignments.labels[i], s))
            scored_codes.append(mine)
        if centroids is not None:
            x = torch.from_numpy(features).to(device)
            nearest = nearest_centroids(x, centroids)
            baseline.add(x, centroids[nearest], nearest[:, None])
            units.append(labels_at_code_rate(nearest.cpu().numpy(), s))
    if skipped:
        log.warning("%d utterance(s) with a NaN or Inf frame left out, the first %s", len(skipped),
                    store.name(skipped[0]))
    try:
        figures = sums.result(s)
    except ValueError as e:  # every utterance left out
        raise BadInputError(f"{store.description}: {e} (every utterance has a NaN or Inf frame)") from None
    result = {"checkpoint": spec.settings["checkpoint"], "step": spec.settings["step"],
              "data_dir": str(data.folder), "split": data.split, "utterances": len(store) - len(skipped),
              "skipped_utterances": len(skipped), "frames": figures["frames"],
              "code_frames": int(lengths.sum() - lengths[skipped].sum()),
              "codebook_size": config.codebook_size, "downsample": s, "beam_size": spec.beam,
              "rel_mse": figures["rel_mse"], "cosine": figures["cosine"], "bits_per_frame": figures["bits_per_frame"]}
    levels = [{"level": level + 1, "usage": usage, "perplexity": perplexity}
              for level, (usage, perplexity) in enumerate(zip(figures["code_usage"], figures["perplexity"]))]
    if alignments is not None:
        labels = np.concatenate(phones)
        for entry, measures in zip(levels, phone_information(labels, np.concatenate(scored_codes))):
            entry.update(measures)
        warn_of_joint_units(levels, len(labels))
        result.update(alignments=alignments.source, phones=len(alignments.phones))
    result["levels"] = levels
    if baseline is not None:
        mapped = baseline.result(1)
        result["baseline"] = {**fitted, "rel_mse": mapped["rel_mse"], "cosine": mapped["cosine"],
                              "bits_per_frame": math.log2(config.codebook_size), "usage": mapped["code_usage"][0],
                              "perplexity": mapped["perplexity"][0]}
        if alignments is not None:
            result["baseline"].update(unit_quality(labels, np.concatenate(units)))
    return result


def number(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def printout(result: dict) -> str:
    """The figures as a table: the codec's, level by level, and the baseline's beside them."""
    lines = [f"{result['split']} of {result['data_dir']}: {result['utterances']} utterances, {result['frames']} "
             f"frames, codes from a beam search {result['beam_size']} wide",
             f"rel_mse {result['rel_mse']:.4f}  cosine {result['cosine']:.4f}  bits/frame "
             f"{result['bits_per_frame']:.1f}"]
    phones = "pnmi" in result["levels"][0]
    header = f"{'level':<8}{'usage':>8}{'perplexity':>12}"
    if phones:
        header += f"{'pnmi':>8}{'phone_pur':>11}{'clus_pur':>10}   1..k:{'pnmi':>7}{'phone_pur':>11}{'clus_pur':>10}"
    lines.append(header)
    for entry in result["levels"]:
        row = f"{entry['level']:<8}{entry['usage']:>8.4f}{entry['perplexity']:>12.2f}"
        if phones:
            row += "".join(f"{number(entry[k]):>{w}}" for k, w in zip(PHONE_KEYS, (8, 11, 10)))
            row += "      " + "".join(f"{number(entry['joint_' + k]):>{w}}" for k, w in zip(PHONE_KEYS, (7, 11, 10)))
        lines.append(row)
    if "baseline" in result:
        b = result["baseline"]
        row = f"{'k-means':<8}{b['usage']:>8.4f}{b['perplexity']:>12.2f}"
        if phones:
            row += "".join(f"{number(b[k]):>{w}}" for k, w in zip(PHONE_KEYS, (8, 11, 10)))
        lines.append(row)
        lines.append(f"k-means baseline: {b['clusters']} clusters fitted on {b['train_frames']} frames of split "
                     f"'{b['split']}' (seed {b['seed']}), rel_mse {b['rel_mse']:.4f}, cosine {b['cosine']:.4f}, "
                     f"{b['bits_per_frame']:.1f} bits/frame")
    if "alignments" in result:
        lines.append(f"phones: {result['phones']} in {result['alignments']}, scored at the code rate")
    return "\n".join(lines)


def evaluate_codec(cfg: EvaluateSettings) -> int:
    if cfg.json is not None and (cfg.json.is_dir() or not cfg.json.parent.is_dir()):
        raise BadInputError(f"--json {cfg.json}: give a file in a folder that exists")
    device = select_device(cfg.device)
    set_cpu_threads(device, log)  # the cores it can get: on cores a neighbour keeps busy, extra threads wait
    model, state, ckpt_path = open_codec(cfg.checkpoint, device)
    data = cfg.data
    store = open_share(data, model.config, ckpt_path)[0]
    spec = codes_spec(cfg.codes, model, state, ckpt_path, device)
    feature_check = check_features(data, state, model, store, ckpt_path, allow_mismatch=cfg.allow_feature_mismatch)[1]
    log.info("features: %s", feature_check)
    alignments = None
    if cfg.alignments is not None:  # everything a user can get wrong is checked before the long work
        rate = dump_feature_settings(data.folder, data.split).get("frame_rate_hz") or FRAME_RATE
        alignments = read_alignments(cfg.alignments, store.lengths, utterance_names(data.folder, data.split, store),
                                     float(rate), describe=store.name)
        log.info("%s: %d phones over %d utterances, at %g frames/s", alignments.source, len(alignments.phones),
                 len(alignments.labels), rate)
    baseline = cfg.baseline
    train = open_baseline_split(data.folder, baseline.split, store.dim) if baseline else None
    centroids = fitted = None
    if train is not None:
        size = model.config.codebook_size
        sample = kmeans_sample(train, size, baseline.seed)
        fitted = {"method": "kmeans", "clusters": size, "split": baseline.split, "train_frames": len(sample),
                  "iterations": KMEANS_ITERS, "seed": baseline.seed}
        log.info("k-means baseline: %d clusters on %d frames of %s (seed %d), k-means++ then %d Lloyd iterations",
                 size, len(sample), train.description, baseline.seed, KMEANS_ITERS)
        centroids, source = fit_baseline(sample, size, baseline.seed, device)
        log.info("k-means baseline: %s", source)
    log.info("%s: %d utterances, %d frames, %s", store.description, len(store), store.total_frames,
             describe_codes(spec))
    codes = encode_split(spec, store)
    result = {**score(data, spec, store, codes, alignments, centroids, fitted, device), "feature_check": feature_check}
    print(printout(result), flush=True)
    if cfg.json is not None:
        os.replace(write_temporary(cfg.json, json.dumps(result, indent=1) + "\n"), cfg.json)
        log.info("wrote %s", cfg.json)
    log.info("finished successfully")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.evaluate", formatter_class=FlagHelpFormatter,
                                description="Score a trained codec on whole utterances of a split: rel_mse, cosine, "
                                            "bits per frame, code usage and perplexity per level; with phone "
                                            "alignments PNMI and purities; beside a k-means baseline.")
    add_checkpoint_arg(p)
    p.add_argument("--data_dir", type=Path, required=True, help="the feature store (as the trainer's --data_dir)")
    p.add_argument("--split", default="valid", help="the split scored")
    add_codes_args(p, km=False)
    p.add_argument("--alignments", type=Path,
                   help="phone alignments of the split: a .phn file of frame labels (one line per utterance, in "
                        "order), a folder of NAME.TextGrid (a 'phones' tier), or a .ctm file (default: none, no "
                        "phone measures)")
    p.add_argument("--baseline", choices=("kmeans",),
                   help=f"also score plain k-means of the codebook size, fitted on at most {KMEANS_FRAMES} frames "
                        "of --baseline_split (default: none)")
    p.add_argument("--baseline_split", default="train", help="the split the k-means baseline is fitted on")
    p.add_argument("--seed", type=int, default=0, help="the k-means baseline's sample and seeding")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file (default: none)")
    p.add_argument("--allow_feature_mismatch", action="store_true",
                   help="score features that do not look like the codec's (as tools.encode), with a warning")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    return p


def parse_args(argv=None) -> EvaluateSettings:
    p = build_parser()
    args = p.parse_args([str(a) for a in (sys.argv[1:] if argv is None else argv)])
    codes = codes_request(p, args)  # tools.encode's codes of the whole split, no .km
    baseline = KmeansBaseline(args.baseline_split, args.seed) if args.baseline else None
    return EvaluateSettings(args.checkpoint, SplitShare(args.data_dir, args.split, 1, 0), codes, args.alignments,
                            baseline, args.json, args.allow_feature_mismatch, args.device)


@bad_input_exits_2(log)
def main(argv=None) -> int:
    return evaluate_codec(parse_args(argv))


if __name__ == "__main__":
    run(main, "evaluate")
