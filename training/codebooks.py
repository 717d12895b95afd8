"""Codebook work outside the training step: feature statistics, the k-means init before the first step,
and the refit after the last.

The k-means init and the refit run collectives (the quantizer's own, and sums
over ranks): every rank calls them together, and the trainer gives them the
slow-phase timeout. Each says what it does when it starts, shows a bar on rank 0,
and looks for a stop between its iterations (training/signals.py, `Chunks`): a stop
raises Stopped on every rank at the same point. The refit also cuts a pass short
between chunks of its sample on a rank asked to stop; the k-means init, whose
passes are the library's, is abandoned at once on a signal (the trainer's).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from data.bad_crops import finite_crops
from data.crops import assemble_crops
from data.stores import FeatureStore
from errors import BadInputError
from models.codec import RVQCodec
from training.distributed import DistContext, all_reduce_sum
from training.signals import Chunks, StopRequest

log = logging.getLogger(__name__)

REFIT_SEED_OFFSET = 7919  # the refit draws its utterances from a stream of its own


def feature_stats(store: FeatureStore, max_utterances: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std over evenly spaced training utterances (the same on every rank). BadInputError
    when they hold fewer than 2 finite frames: features that are NaN or Inf throughout, which no step could use."""
    picks = sorted(set(int(i) for i in torch.linspace(0, len(store) - 1, min(len(store), max_utterances))))
    with store.scattered_reads():
        frames = torch.cat([torch.from_numpy(store.utterance(i).astype("float64")) for i in picks])
    total = len(frames)
    frames = frames[torch.isfinite(frames).all(1)]  # a bad frame must not set every feature's scale
    if len(frames) < 2:
        raise BadInputError(f"{store.description}: {total - len(frames)} of the {total} frames of {len(picks)} "
                            "utterances read evenly across the split for the features' mean and scale hold NaN or "
                            "Inf; python -m tools.check on the --data_dir names every such utterance")
    return frames.mean(0).float(), frames.std(0).float()


def kmeans_sample(store: FeatureStore, frames: int, length: int, seed: int) -> torch.Tensor:
    """Random crops of `length` frames from this rank's utterances, about `frames` frames in all."""
    rng = torch.Generator().manual_seed(seed)
    long_enough = np.flatnonzero(store.lengths >= length)
    picks = [int(long_enough[int(j)]) for j in torch.randint(len(long_enough), (max(1, frames // length),), generator=rng)]
    starts = [int(torch.randint(int(store.lengths[i]) - length + 1, (1,), generator=rng)) for i in picks]
    with store.scattered_reads():
        return torch.from_numpy(assemble_crops(store, picks, starts, length))


def init_codebooks(model: RVQCodec, shard: FeatureStore, *, frames: int, length: int, seed: int, batch_frames: int,
                   ctx: DistContext, stop: StopRequest) -> None:
    """k-means on more frames than one batch holds (2048 frames are thin for 1024 codes), before the first step.

    The library syncs it across ranks: every rank calls it together. A stop agreed between two iterations raises
    Stopped (the codebooks are then part initialised: nothing to save); the trainer also abandons it at once on a
    signal (StopRequest.abandoning), since one iteration is a pass over the whole sample.
    """
    config = model.config
    start = time.perf_counter()
    log.info("codebooks: k-means init of %d levels x %d codes (%d iterations each) on about %d frames per rank",
             config.num_quantizers, config.codebook_size, config.kmeans_iters, frames)
    sample = kmeans_sample(shard, frames, length, seed).to(ctx.device)
    with Chunks("k-means init", total=config.num_quantizers * config.kmeans_iters, unit="iter", ctx=ctx,
                stop=stop) as chunks:
        model.init_codebooks(sample, batch_frames=batch_frames, keep=finite_crops(sample), between=chunks)
    log.info("codebooks: k-means init on %d frames per rank in %.1f s", sample.shape[0] * sample.shape[1],
             time.perf_counter() - start)


def refit_utterances(store: FeatureStore, frames: int, seed: int) -> list[torch.Tensor]:
    """Whole utterances of this rank's shard in a random order, up to about `frames` frames."""
    order = torch.randperm(len(store), generator=torch.Generator().manual_seed(seed)).numpy()
    picked, total = [], 0
    with store.scattered_reads():
        for i in order:
            if total >= frames:
                break
            utterance = torch.from_numpy(store.utterance(int(i)).astype("float32"))
            if torch.isfinite(utterance).all():  # the training loop drops such an utterance too
                picked.append(utterance)
                total += len(utterance)
    return picked


def refit(model: RVQCodec, shard: FeatureStore, ctx: DistContext, *, iters: int, frames: int, batch_frames: int,
          seed: int, step: int, metrics, stop: StopRequest) -> None:
    """The codebooks' last pass: Lloyd's k-means over whole utterances of every rank (all ranks together). A stop
    between two Lloyd steps raises Stopped, the codebooks part refitted (the caller puts its copy back)."""
    config = model.config
    start = time.perf_counter()
    log.info("codebooks: refit of %d levels x %d codes (%d Lloyd iteration(s) each, for a beam %d wide) on up to "
             "%d frames per rank", config.num_quantizers, config.codebook_size, iters, config.beam_size,
             min(frames, shard.total_frames))
    utterances = [u.to(ctx.device) for u in refit_utterances(shard, frames, seed + REFIT_SEED_OFFSET + ctx.rank)]
    model.eval()  # no EMA update in the passes the refit makes
    try:
        with Chunks("refit", total=config.num_quantizers * (iters + 1) + 1, unit="pass", ctx=ctx,
                    stop=stop) as chunks:
            errors = model.refit_codebooks(utterances, iters, batch_frames=batch_frames,
                                           all_reduce=lambda t: all_reduce_sum(ctx, t), seed=seed, between=chunks,
                                           cut_short=chunks.requested)
    finally:
        model.train()
    seconds = time.perf_counter() - start
    used = sum(len(u) for u in utterances)
    metrics.write("refit", step, frames_per_rank=used, iters=iters, residual_mse=errors, seconds=round(seconds, 1))
    log.info("codebooks: refit with %d k-means iteration(s) per level on %d frames per rank in %.1f s; residual "
             "MSE after each level %s", iters, used, seconds, [f"{e:.3g}" for e in errors])
