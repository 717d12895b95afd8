"""The codec's codebook operations, on the quantizer's own buffers: the refit after training (Lloyd steps over
beam residuals, faiss's split of an empty code), the beam's extension by a level, the beam score's weights, and
dead-code expiry and its counts.

vector-quantize-pytorch's ResidualVQ keeps the codebooks (`layer._codebook.embed`, its EMA sizes and sums);
these functions read and set them, the codec (models/codec.py) calls them, and nothing in training/ touches
`_codebook`. They take the codec (an RVQCodec) as `model`.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

# The library's beam search scores a partial code sequence by the sum over its levels of each level's residual
# error, weighted per level; weights that grow by this factor per level make the score the current residual's
# error (the earlier levels' terms vanish beside it), which is what the reconstruction keeps: lower held-out
# rel_mse at beam 4 than equal weights (benchmarks/README.md).
BEAM_SCORE_GROWTH = 1000.0
# Rows per pass of the refit's and the k-means' distance computations ([rows, codebook_size] at most), by device:
# on a CPU the distances stay within the caches, the same results in less time (benchmarks/bench_refit.py); on a
# GPU fewer, larger kernels. A pass is also how often the refit looks at cut_short.
REFIT_CHUNK = {"cpu": 4096, "cuda": 16384}
RARE_SHARE = 0.1  # the refit moves a code that wins fewer than this share of the mean frames per code (and none)


@torch.no_grad()
def refit_codebooks(model: nn.Module, utterances: list[torch.Tensor], iters: int, batch_frames: int,
                    all_reduce=None, seed: int = 0, between=None, cut_short=None) -> list[float]:
    """Residual k-means of every level in turn over the latents of whole training utterances, for the beam
    search that encodes (`beam_size`).

    The EMA codebooks are online k-means on one batch at a time, on residuals that moved while the
    encoder learned, under the nearest-code choice training makes; this pass fits each level to the
    residuals that the final encoder and the levels before it leave under the beam search, as faiss's
    ResidualQuantizer trains: Lloyd's k-means over the residuals of every partial code sequence the beam
    keeps for each frame (`beam_size` of them; one with beam 1), then each sequence is extended by its
    `beam_size` nearest codes of the refitted level and the `beam_size` closest kept per frame. Fitting
    every sequence the beam keeps, not only the best, is what gains on held-out frames (benchmarks/README.md).
    Each level starts from its trained codebook (so the decoder keeps the codes it learned) and runs `iters`
    Lloyd steps; a code that wins no residual, or fewer than RARE_SHARE of the mean, takes half of a
    populous code's (faiss's rule for empty codes), so that held-out frames find few codes idle. A few
    iterations gain most of it: more fit the training frames closer and use fewer codes on held-out ones.

    utterances: this rank's, [T, D] each. `all_reduce` sums a tensor over ranks in place: every rank must
    call this together, and every rank ends with the same codebooks (the splits draw from `seed`, the
    same on every rank). Eval mode (no EMA update); the EMA statistics are set to what one batch of
    `batch_frames` gives. Returns the mean squared residual per latent dimension after each level, of each
    frame's best sequence, over the frames of all ranks. between(): called before each Lloyd step and each
    beam extension, and once at the end ((iters + 1) x levels + 1 calls), at the same points on every rank;
    it may raise to abandon the refit, whose levels are then part refitted: the caller keeps a copy
    (`codebook_state`) to put back. cut_short(): looked at between two utterances encoded and between
    REFIT_CHUNK rows of a pass, on this rank alone; when true the rest is skipped (the sums over ranks are still
    joined), and the next between() must raise: what was computed is not used.
    """
    if model.training:
        raise RuntimeError("refit_codebooks() runs the quantizer in eval mode; call model.eval() first")
    reduce = all_reduce or (lambda t: t)
    s, beam = model.config.downsample, model.config.beam_size
    whole = [u[: len(u) // s * s] for u in utterances if len(u) >= s]
    latent = []
    for u in whole:
        if latent and cut_short is not None and cut_short():
            break
        latent.append(model._encode_latent(u[None])[0])
    latent = torch.cat(latent).float()
    total = reduce(torch.tensor([float(len(latent))], device=latent.device)).item()
    generator = torch.Generator().manual_seed(seed)
    # [frames, sequences, dim]; the levels' own projections are identities in ResidualVQ (each level is
    # built with the codebook dim), so residuals and codes share one space
    residual = model.rvq.project_in(latent)[:, None]
    between = between or (lambda: None)
    errors = []
    for layer in model.rvq.layers:
        codebook = layer._codebook
        means, counts = codebook.embed[0].detach().clone(), None
        for _ in range(iters):
            between()
            means, counts = lloyd_step(residual.flatten(0, 1), means, reduce, cut_short)
            counts = counts.masked_fill(counts < RARE_SHARE * counts.double().mean(), 0)
            split_empty_codes(means, counts, generator)
            if model.config.cosine_codebooks:  # unit codes: the nearest is the most similar, the mean's direction
                means = torch.nn.functional.normalize(means, dim=-1)
        codebook.embed.copy_(means[None])
        if counts is not None:
            size = counts.float() * (batch_frames / counts.sum().item())
            codebook.cluster_size.copy_(size[None])
            codebook.embed_avg.copy_((means * size[:, None])[None])
        between()
        residual = extend_beam(residual, means, beam, cut_short)
        error = reduce((residual[:, 0].double() ** 2).sum().reshape(1))
        errors.append(error.item() / total / residual.shape[-1])
    between()  # the last pass may have been cut short
    return errors


@torch.no_grad()
def expire_dead_codes(model: nn.Module, latent: torch.Tensor, codes: torch.Tensor) -> int:
    """The library's dead-code expiry (its `expire_codes_`) on every level that has a dead code: each code
    whose EMA cluster size is below the threshold is re-seeded from this batch's residuals at that level.
    latent, codes: the `latent` and `codes` of the step's training forward (the residual at a level is the
    latent less the codes of the levels before, as in that forward; no encoder runs again here).
    A training-mode call that every rank makes at the same step: the library samples the new codes across
    ranks, and the EMA sizes it reads are alike on every rank. One host read finds the levels with dead
    codes (none: nothing else runs); the library reads each such level twice more. Returns their number."""
    if not model.training:
        raise RuntimeError("expire_dead_codes() is training bookkeeping; call model.train() first")
    threshold = model.config.dead_code_threshold
    if threshold <= 0:
        return 0
    levels = model.rvq.layers
    flags = torch.stack([layer._codebook.cluster_size.lt(threshold).any() for layer in levels])
    weights = 2 ** torch.arange(len(levels), device=flags.device, dtype=torch.float64)
    packed = int((flags * weights).sum().item())  # one host read for every level (exact up to 2^53)
    dead = [bool(packed >> level & 1) for level in range(len(levels))]
    if not any(dead):
        return 0
    residual = model.rvq.project_in(latent.float()).flatten(0, 1)  # [frames, codebook_dim]
    codes = codes.flatten(0, 1)  # [frames, levels]; -1 where dropped out
    for level in range(max(i for i, has_dead in enumerate(dead) if has_dead) + 1):
        codebook = levels[level]._codebook
        # this level's codes as the forward's EMA update left them (the library's get_codes_from_indices,
        # without its einops calls, much of an expiry's host time on a small codec); 0 where dropped out
        code = codes[:, level]
        quantized = torch.where(code[:, None] >= 0, codebook.embed[0].index_select(0, code.clamp_min(0)), 0.0)
        if dead[level]:
            codebook.has_dead_code_replacement = True
            try:  # [1, frames, dim]: the library reads the first dim as its codebook heads
                levels[level].expire_codes_(residual[None])
            finally:
                codebook.has_dead_code_replacement = False
        residual = residual - quantized
    return sum(dead)


def calling_between(reduce, between):
    """The library's k-means all-reduce with between() before every other call: each of its k-means iterations
    reduces twice (the counts, then the sums), so between() runs before each iteration."""
    calls = itertools.count()

    def reduce_between(tensor):
        if next(calls) % 2 == 0:
            between()
        return reduce(tensor)

    return reduce_between


def chunk_rows(t: torch.Tensor) -> int:
    """REFIT_CHUNK for t's device (a device not listed: the GPU's)."""
    return REFIT_CHUNK.get(t.device.type, REFIT_CHUNK["cuda"])


def lloyd_step(samples: torch.Tensor, means: torch.Tensor, reduce,
               cut_short=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lloyd iteration: [N, d] samples assigned to the nearest of [K, d] means, the sums and counts summed
    over ranks by `reduce` (in place); returns the new means (a code with no sample keeps its old one) and the
    counts [K]. REFIT_CHUNK rows at a time: the library's `kmeans` holds the whole [N, K] distance matrix, in
    several temporaries, which at a refit's million beam residuals is gigabytes each and longer (benchmarks/README.md,
    "Beyond beam 1").
    cut_short(): when true, the rows left are skipped (the sums are still reduced)."""
    sums, counts = torch.zeros_like(means), torch.zeros(len(means), dtype=torch.long, device=means.device)
    norms = (means * means).sum(-1)
    for chunk in samples.split(chunk_rows(samples)):
        if cut_short is not None and cut_short():
            break
        nearest = torch.addmm(norms, chunk, means.T, alpha=-2).argmin(-1)  # ||x||^2 is the same for every code
        sums.index_add_(0, nearest, chunk)
        counts += torch.bincount(nearest, minlength=len(means))
    reduce(sums)
    reduce(counts)
    return torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], means), counts


def extend_beam(residual: torch.Tensor, codebook: torch.Tensor, beam: int, cut_short=None) -> torch.Tensor:
    """[N, b, d] residuals of b partial code sequences per frame -> [N, beam, d] (fewer where the codebook is
    smaller): each sequence extended by its `beam` nearest codes of `codebook` [K, d], and the `beam` extended
    sequences with the smallest residual kept per frame, best first. cut_short(): when true after a chunk, the
    frames left are dropped (fewer rows out)."""
    norms = (codebook * codebook).sum(-1)
    out = []
    for chunk in residual.split(max(1, chunk_rows(residual) // residual.shape[1])):
        if out and cut_short is not None and cut_short():
            break
        n, b, d = chunk.shape
        dist = torch.addmm(norms, chunk.reshape(n * b, d), codebook.T, alpha=-2).view(n, b, -1)
        dist += (chunk * chunk).sum(-1, keepdim=True)  # the squared residual each extension leaves
        k = min(beam, len(codebook))
        nearest_dist, nearest = dist.topk(k, dim=-1, largest=False)  # [n, b, k]
        keep = nearest_dist.flatten(1).topk(min(beam, b * k), dim=1, largest=False).indices  # [n, beam], sorted
        parent, code = keep // k, nearest.flatten(1).gather(1, keep)
        out.append(chunk.gather(1, parent[..., None].expand(-1, -1, d)) - codebook[code])
    return torch.cat(out)


def beam_score_weights(levels: int) -> list[float]:
    """Per level, the weight of its error in the library's beam score: BEAM_SCORE_GROWTH times the level
    before's, the last level 1 (float32 keeps weights down to about 1e-38; smaller ones are held at 1e-30)."""
    return [max(BEAM_SCORE_GROWTH ** (level - levels + 1), 1e-30) for level in range(levels)]


def split_empty_codes(means: torch.Tensor, counts: torch.Tensor, generator: torch.Generator) -> None:
    """In place: each code with no frame [K, d] / [K] moves next to a code drawn in proportion to its frames
    beyond the first, the two a symmetric hair apart (as faiss's k-means splits clusters), and takes half of
    its count; the next Lloyd step parts them."""
    empty = (counts == 0).nonzero().flatten().tolist()
    weight = (counts.double() - 1).clamp_min(0)
    sign = torch.ones(means.shape[-1], dtype=means.dtype, device=means.device)
    sign[1::2] = -1
    for code in empty:
        if weight.sum() <= 0:
            break
        donor = int(torch.multinomial(weight.cpu(), 1, generator=generator))
        centre = means[donor].clone()
        means[code] = centre * (1 + sign / 1024)
        means[donor] = centre * (1 - sign / 1024)
        half = counts[donor] // 2
        counts[code], counts[donor] = half, counts[donor] - half
        weight[code], weight[donor] = (half - 1).clamp_min(0), (counts[donor] - 1).clamp_min(0)


def init_done(data, mask=None) -> None:
    """A level's k-means init, once it is done: nothing to check (the library's reads its flag on the host)."""


def dead_code_counts(model: nn.Module) -> list[int]:
    """Per level, the codes whose EMA cluster size is at or below the dead-code threshold: the library
    re-seeds a code whose size falls below it (with size = threshold), so these are the codes expired at
    the last steps that have not won frames since. The EMA is synced across ranks: every rank agrees."""
    threshold = model.config.dead_code_threshold
    return [int((layer._codebook.cluster_size[0] <= threshold).sum()) for layer in model.rvq.layers]


def codebook_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The codebook of every level, [codebook_size, codebook_dim] each."""
    return [layer._codebook.embed[0] for layer in model.rvq.layers]


@torch.no_grad()
def set_codebooks(model: nn.Module, codebooks: torch.Tensor) -> None:
    """Every level's codebook from [levels, codebook_size, codebook_dim] (codebook_tensors stacked, as an export
    holds them), each level marked initialised; the EMA sizes and sums, which only training reads, are left as
    they are."""
    levels = model.rvq.layers
    if tuple(codebooks.shape) != (len(levels), *levels[0]._codebook.embed.shape[1:]):
        raise ValueError(f"codebooks of shape {tuple(codebooks.shape)} for a quantizer of {len(levels)} levels of "
                         f"{tuple(levels[0]._codebook.embed.shape[1:])}")
    for layer, codebook in zip(levels, codebooks):
        layer._codebook.embed.copy_(codebook[None])
        layer._codebook.initted.fill_(True)
