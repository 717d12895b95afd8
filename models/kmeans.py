"""Plain k-means of feature frames: the baseline that discrete speech units are usually compared with (HuBERT's
units are k-means of a layer's features; fairseq's simple_kmeans). k-means++ seeding, then a fixed number of
Lloyd iterations (models/codebook_ops.py lloyd_step, with faiss's rule for a cluster left empty, split_empty_codes),
all drawn from one seed: the same sample and seed give the same centroids.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from models.codebook_ops import chunk_rows, lloyd_step, split_empty_codes

KMEANS_ITERS = 20  # Lloyd iterations after the k-means++ seeding


def squared_distances(samples: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """[N, d] x [K, d] -> [N, K] squared Euclidean distances (clamped at 0 against rounding)."""
    return torch.addmm((means * means).sum(-1), samples, means.T, alpha=-2).add_(
        (samples * samples).sum(-1, keepdim=True)).clamp_min_(0)


def kmeans_plus_plus(samples: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (Arthur and Vassilvitskii 2007): the first centroid a sample drawn uniformly, each next one
    a sample drawn with probability proportional to its squared distance to the nearest centroid so far."""
    n = len(samples)
    means = torch.empty(k, samples.shape[1], dtype=samples.dtype, device=samples.device)
    means[0] = samples[int(torch.randint(n, (1,), generator=generator))]
    nearest = squared_distances(samples, means[:1])[:, 0]
    for j in range(1, k):
        weights = nearest.double().cpu()
        pick = int(torch.multinomial(weights, 1, generator=generator)) if weights.sum() > 0 else \
            int(torch.randint(n, (1,), generator=generator))  # every sample is a centroid already
        means[j] = samples[pick]
        nearest = torch.minimum(nearest, squared_distances(samples, means[j : j + 1])[:, 0])
    return means


@torch.no_grad()
def fit_kmeans(samples: torch.Tensor, k: int, *, iters: int = KMEANS_ITERS, seed: int = 0,
               on_iteration: Callable[[], None] | None = None) -> torch.Tensor:
    """[K, d] float32 centroids of `samples` [N, d] (N >= k): k-means++ seeding, then `iters` Lloyd iterations,
    a cluster left empty split off a populous one. on_iteration(): after the seeding and after each iteration."""
    samples = samples.float()
    if len(samples) < k:
        raise ValueError(f"{len(samples)} samples for {k} clusters")
    generator = torch.Generator().manual_seed(seed)
    means = kmeans_plus_plus(samples, k, generator)
    if on_iteration is not None:
        on_iteration()
    for _ in range(iters):
        means, counts = lloyd_step(samples, means, lambda tensor: tensor)
        split_empty_codes(means, counts, generator)
        if on_iteration is not None:
            on_iteration()
    return means


@torch.no_grad()
def nearest_centroids(samples: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """[N] int64: the nearest of `means` [K, d] to each of `samples` [N, d]."""
    norms = (means * means).sum(-1)
    return torch.cat([torch.addmm(norms, chunk, means.T, alpha=-2).argmin(-1)
                      for chunk in samples.float().split(chunk_rows(samples))]) if len(samples) else \
        torch.zeros(0, dtype=torch.int64)
