"""The RVQ codec: conv encoder -> vector_quantize_pytorch.ResidualVQ -> conv decoder.

Features are standardised with per-dimension statistics of the training data,
kept as buffers so that `encode` and `decode` work from a checkpoint alone.
The forward pass returns the reconstruction, the codes and the loss terms,
nothing larger, so nothing big can be gathered or reduced by mistake.
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from vector_quantize_pytorch import ResidualVQ

from models.conv_products import ConvProducts
from models.graph_passes import GraphPasses
from models.one_hot_products import OneHotProducts

# Steps between dead-code expiries (benchmarks/README.md, "Dead-code expiry"): each expiry reads the codebooks on
# the host, so a GPU step waits for it; between expiries the step runs without a host sync from the quantizer.
DEAD_CODE_EVERY = 2


@dataclass
class CodecConfig:
    """The codec's shape and its quantizer's options. Each field with a default is also the trainer's flag of
    the same name (`--latent_dim` ...), with the help text in its metadata; "flag": False keeps one off the
    command line."""

    feature_dim: int
    latent_dim: int = field(default=160, metadata={
        "help": "channels of the encoder's output, which the quantizer codes"})
    codebook_dim: int | None = field(default=None, metadata={"help": "none: the latent dim (no projection)"})
    num_quantizers: int = field(default=8, metadata={"help": "residual levels: codes per code frame"})
    codebook_size: int = field(default=1024, metadata={"help": "codes per level"})
    downsample: int = field(default=1, metadata={"choices": (1, 2, 4), "help": "frames per code"})
    encoder_blocks: int = field(default=2, metadata={
        "help": "residual conv blocks in the encoder and in the decoder each"})
    kmeans_init: bool = field(default=True, metadata={
        "help": "initialise the codebooks by k-means (see --kmeans_init_frames; false: random codes)"})
    kmeans_iters: int = field(default=10, metadata={"flag": False})
    ema_decay: float = field(default=0.99, metadata={
        "kind": "fraction", "help": "decay of the codebooks' exponential moving averages"})
    dead_code_threshold: float = field(default=0.5, metadata={
        "kind": "nonnegative", "help": "re-seed a code whose EMA count of frames per step falls below this"})
    dead_code_every: int = field(default=DEAD_CODE_EVERY, metadata={
        "help": "steps between dead-code expiries, at the same steps on every rank (1: after every step); the "
                "steps between run without the expiry's host syncs"})
    quantize_dropout: bool = field(default=False, metadata={"help": "train for variable bitrate (fewer levels)"})
    cosine_codebooks: bool = field(default=False, metadata={
        "help": "vector-quantize-pytorch's cosine-similarity codebooks (each level's input and codes l2-normalised; "
                "the refit's means too) instead of Euclidean ones"})
    rotation_trick: bool = field(default=False, metadata={
        "help": "carry the gradient through the quantizer by vector-quantize-pytorch's rotation trick (Fifty et al. "
                "2024) instead of the straight-through copy"})
    commitment_weight: float = field(default=0.25, metadata={
        "kind": "nonnegative", "help": "weight of the commitment loss (encoder output to its codes) in the loss"})
    beam_size: int = field(default=4, metadata={
        "help": "partial code sequences the encoder's beam search over the levels keeps per frame (1: the nearest "
                "code level by level); the end-of-schedule refit trains the codebooks for it"})
    recon_space: str = field(default="feature", metadata={
        "choices": ("feature", "standardised"),
        "help": "reconstruction MSE in feature space (each dim weighted by its variance, as rel_mse counts errors) "
                "or on the standardised features (every dim alike)"})

    def to_dict(self) -> dict:
        return asdict(self)


# The compiled CPU step's graph rewrites (inductor's pre-grad custom pass; the eager step is unchanged): the
# quantizer's products with its one-hot code matrix become a gather and a scatter-add where large (the default
# codec's compiled trainer 1.51x the eager one of before --compile, 1.27x without), and a small convolution one
# matrix product (benchmarks/README.md, "The compiled step").
ONE_HOT_PRODUCTS, CONV_PRODUCTS = OneHotProducts(), ConvProducts()
# Inductor's options for the compiled training step (compile_training), by device type. On a CPU its C++ wrapper
# runs each compiled graph instead of the generated Python one: the same kernels, ~0.4 ms less host time per step
# of the tiny codec (the Python wrapper's ~300 buffer views and checks a step), no longer to compile; and the
# rewrites above. On CUDA neither until a GPU run has measured them there (the step is bound by the host, and a
# product is a tensor-core kernel); --compile cudagraphs replays the graphs without a wrapper.
COMPILE_OPTIONS = {"cpu": {"cpp_wrapper": True, "pre_grad_custom_pass": GraphPasses(ONE_HOT_PRODUCTS, CONV_PRODUCTS)}}
# --compile cudagraphs: each compiled graph (forward, backward) captured in a CUDA graph and replayed, its outputs
# static buffers that the next replay overwrites. Not torch.compile's reduce-overhead mode, which is these options
# with cudagraph trees: on an H100 (torch 2.11) the trees freed a step's forward outputs while its backward still
# needed them and the run failed at its second step; without them it trained (benchmarks/README.md).
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_trees": False}
MIN_ENCODE_STEPS = 16  # code frames: the shortest pass RVQCodec.encode runs (shorter inputs are zero-padded)
# The library's beam search scores a partial code sequence by the sum over its levels of each level's residual
# error, weighted per level; weights that grow by this factor per level make the score the current residual's
# error (the earlier levels' terms vanish beside it), which is what the reconstruction keeps: 2% lower held-out
# rel_mse at beam 4 than equal weights (benchmarks/README.md).
BEAM_SCORE_GROWTH = 1000.0
REFIT_CHUNK = 16384  # frames per pass of the refit's distance computations: [chunk x beam, codebook_size] at most
RARE_SHARE = 0.1  # the refit moves a code that wins fewer than this share of the mean frames per code (and none)


class CodecOutput(NamedTuple):
    reconstruction: torch.Tensor  # [B, T, D], in feature space
    codes: torch.Tensor  # [B, T / downsample, Q], -1 where dropped out
    recon_loss: torch.Tensor  # MSE, standardised, each dim weighted by its variance when recon_space="feature"
    commit_loss: torch.Tensor  # summed over levels
    loss: torch.Tensor
    latent: torch.Tensor  # [B, T / downsample, latent_dim]: the quantizer's input, detached (expire_dead_codes)


class Conv1d(nn.Conv1d):
    """nn.Conv1d whose inference on the CPU always runs oneDNN's kernel. PyTorch otherwise picks oneDNN or its
    own kernel by the input's batch size and length, and the two round differently: an utterance's codes would
    depend on the batch it is encoded in. Training (autograd) keeps PyTorch's choice."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (not self.training and not torch.is_grad_enabled() and input.device.type == "cpu"
                and input.dtype == torch.float32 and self.padding_mode == "zeros" and isinstance(self.padding, tuple)
                and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return torch.ops.aten.mkldnn_convolution(input.contiguous(), weight, bias, self.padding, self.stride,
                                                     self.dilation, self.groups)
        return super()._conv_forward(input, weight, bias)


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = Conv1d(channels, channels, 3, padding=1)
        self.conv2 = Conv1d(channels, channels, 1)

    def forward(self, x):
        return x + self.conv2(F.gelu(self.conv1(F.gelu(x))))


class RVQCodec(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        if config.recon_space not in ("feature", "standardised"):
            raise ValueError(f"recon_space must be 'feature' or 'standardised', not {config.recon_space!r}")
        if config.downsample not in (1, 2, 4):
            raise ValueError(f"downsample must be 1, 2 or 4, not {config.downsample}")
        if config.beam_size < 1:
            raise ValueError(f"beam_size must be 1 or more, not {config.beam_size}")
        self.config = config
        c, d, s = config.latent_dim, config.feature_dim, config.downsample
        self.register_buffer("feature_mean", torch.zeros(d))
        self.register_buffer("feature_std", torch.ones(d))
        down = [Conv1d(c, c, 2 * s, stride=s, padding=s // 2)] if s > 1 else []
        up = [nn.ConvTranspose1d(c, c, 2 * s, stride=s, padding=s // 2)] if s > 1 else []
        # no activation outside the residual blocks: a linear path runs from input to output, so the
        # autoencoder starts near a linear map and the quantizer, not the convs, sets the error
        self.encoder = nn.Sequential(
            Conv1d(d, c, 3, padding=1),
            *[ResidualBlock(c) for _ in range(config.encoder_blocks)],
            *down,
            Conv1d(c, c, 1),
        )
        self.decoder = nn.Sequential(
            Conv1d(c, c, 3, padding=1),
            *up,
            *[ResidualBlock(c) for _ in range(config.encoder_blocks)],
            Conv1d(c, d, 3, padding=1),
        )
        self.rvq = ResidualVQ(
            dim=c,
            num_quantizers=config.num_quantizers,
            codebook_size=config.codebook_size,
            codebook_dim=config.codebook_dim,
            kmeans_init=config.kmeans_init,
            kmeans_iters=config.kmeans_iters,
            decay=config.ema_decay,
            threshold_ema_dead_code=config.dead_code_threshold,
            quantize_dropout=config.quantize_dropout,
            commitment_weight=1.0,
            rotation_trick=config.rotation_trick,
            use_cosine_sim=config.cosine_codebooks,
            beam_score_quantizer_weights=beam_score_weights(config.num_quantizers),
        )
        # The library's per-forward bookkeeping, run when this codec says (see "Bookkeeping" below): no
        # expiry inside a forward, only in expire_dead_codes()
        for codebook in self._codebooks():
            codebook.has_dead_code_replacement = False
        self._init_settled = False  # set once every level's k-means init is done: forwards stop checking for it
        self._compiled_forward = None  # the training forward under torch.compile (compile_training)
        self._cuda_graphs = False  # compiled with CUDA graphs (compile_training's "cudagraphs")
        self._compiled_variants = set()  # (input shape, dropout seed) the compiled forward has run with
        self._quantizer_buffers = None  # list(self.rvq.buffers()), listed once: walking the modules costs ~0.1 ms

    def _apply(self, fn, *args, **kwargs):
        self._quantizer_buffers = None  # .to(), .cuda(), .half() replace the buffers
        return super()._apply(fn, *args, **kwargs)

    def quantizer_buffers(self) -> list[torch.Tensor]:
        """Every buffer of the quantizer (codebooks, EMA sizes and sums, init flags), in a fixed order."""
        if self._quantizer_buffers is None:
            self._quantizer_buffers = list(self.rvq.buffers())
        return self._quantizer_buffers

    @torch.no_grad()
    def set_feature_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std.clamp_min(1e-5))

    def _drop_crops(self, features: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The features with each crop not kept replaced by a copy of the first kept one (zeros when none is):
        the quantizer sees only real frames, with no host sync and no mask. The library's mask path costs
        about 4 ms of host time per training step (its einx calls), more than a whole step of a small codec
        on a GPU; a duplicated crop weighs twice in the EMA statistics of a step that dropped one."""
        if keep is None:
            return features
        # index_select, not features[i]: a tensor index would be read on the host (a sync every step)
        first = features.index_select(0, keep.to(torch.int8).argmax().view(1))  # crop 0 when none is kept
        spare = torch.where(keep.any(), first, torch.zeros((), dtype=features.dtype, device=features.device))
        return torch.where(keep[:, None, None], features, spare)

    def _encode_latent(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T', C].

        lengths [B]: each row's frames (multiples of the downsample). The frames past them are zeroed at the
        input of every layer, as a conv pads a sequence's ends, and the pass is at least MIN_ENCODE_STEPS code
        frames long (the conv kernel for a one-frame output rounds differently): a row's latent is bit for bit
        that of its own frames, whatever the batch; what comes out past them is meaningless."""
        if lengths is None:
            x = (features - self.feature_mean) / self.feature_std
            return self.encoder(x.transpose(1, 2)).transpose(1, 2)
        short = MIN_ENCODE_STEPS * self.config.downsample - features.shape[1]
        if short > 0:
            features = F.pad(features, (0, 0, 0, short))
        frames = features.shape[1]
        x = ((features - self.feature_mean) / self.feature_std).transpose(1, 2)
        for layer in self.encoder:
            past_end = torch.arange(x.shape[-1], device=x.device) >= (lengths * x.shape[-1] // frames)[:, None, None]
            x = layer(x.masked_fill(past_end, 0.0))
        return x.transpose(1, 2)

    def _decode_latent(self, latent: torch.Tensor) -> torch.Tensor:
        x = self.decoder(latent.transpose(1, 2)).transpose(1, 2)
        return x * self.feature_std + self.feature_mean

    def forward(self, features: torch.Tensor, keep: torch.Tensor | None = None, beam_size: int = 1,
                dropout_seed: int | None = None) -> CodecOutput:
        """features: [B, T, D] with T a multiple of the downsample factor.

        keep: [B] bool, the crops to train on (data/bad_crops.py); the others are replaced by a copy of a kept
        crop for the quantizer (`_drop_crops`) and left out of the reconstruction loss, with the batch's shape
        unchanged so the quantizer's collectives and DDP run as on any step. When a rank keeps no crop its
        loss is made non-finite, so every rank skips the step (and restores the codebooks).
        beam_size: in eval mode, the codes of a beam search this wide (`encode`'s); training picks the nearest
        code at each level.
        dropout_seed: with quantize_dropout, the seed of this training forward's dropout depth, the same on every
        rank (the trainer's --seed and step); None: the library draws one on the device and all-reduces it.
        In training mode, after compile_training() and once the k-means init is done, the compiled forward runs."""
        if beam_size > 1 and self.training:
            raise RuntimeError("a beam search runs in eval mode only; training picks the nearest code at each level")
        self._settle_init()
        seed = self._dropout_seed(dropout_seed)
        if self.training and self._compiled_forward is not None and self._init_settled:
            variant = (tuple(features.shape), seed)
            if self._cuda_graphs and variant not in self._compiled_variants:
                self._capture(features, keep, seed)
            self._compiled_variants.add(variant)
            return self._compiled_forward(features, keep, 1, seed)
        return self._forward(features, keep, beam_size, seed)

    def _capture(self, features: torch.Tensor, keep: torch.Tensor | None, seed: int | None) -> None:
        """The first call of a graph under CUDA graphs runs it twice, a warm-up and then the capture's replay, so
        the library's codebook updates inside the graph would land twice in that step. That call is made here,
        its outputs dropped and the quantizer put back as it was: the step's own call is then one replay."""
        state = self.codebook_state()
        self._compiled_forward(features, keep, 1, seed)
        self.restore_codebook_state(state)

    def _forward(self, features: torch.Tensor, keep: torch.Tensor | None, beam_size: int = 1,
                 dropout_seed: int | None = None) -> CodecOutput:
        features = self._drop_crops(features, keep)
        latent = self._encode_latent(features)
        quantized, codes, commit = self.rvq(latent, beam_size=beam_size if beam_size > 1 else None,
                                            rand_quantize_dropout_fixed_seed=dropout_seed)
        recon_std = self.decoder(quantized.transpose(1, 2)).transpose(1, 2)
        target_std = (features - self.feature_mean) / self.feature_std
        sq_error = (recon_std.float() - target_std.float()) ** 2
        if self.config.recon_space == "feature":  # the error rel_mse measures, over the mean variance
            weight = self.feature_std.float() ** 2
            sq_error = sq_error * (weight / weight.mean())
        if keep is None:
            recon_loss = sq_error.mean()
        else:  # the mean over kept crops; x / False is inf: no crop kept makes the step non-finite
            recon_loss = (sq_error.mean((1, 2)) * keep).sum() / keep.sum()
        commit_loss = commit.float().sum()
        loss = recon_loss + self.config.commitment_weight * commit_loss
        reconstruction = recon_std * self.feature_std + self.feature_mean
        return CodecOutput(reconstruction, codes, recon_loss, commit_loss, loss, latent.detach())

    @torch.no_grad()
    def codebook_state(self, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A device copy of every quantizer buffer (codebooks, EMA sizes and sums, init flags): the library
        updates them inside the training forward, before any gradient check; no host sync. into: the list an
        earlier call returned, copied into in one multi-tensor op with no allocation (the trainer's every step)."""
        buffers = self.quantizer_buffers()
        if into is None or len(into) != len(buffers):
            return [buffer.detach().clone() for buffer in buffers]
        torch._foreach_copy_(into, buffers)
        return into

    @torch.no_grad()
    def restore_codebook_state(self, state: list[torch.Tensor]) -> None:
        """Put back what `codebook_state` copied: a skipped step leaves the quantizer as it was."""
        buffers = self.quantizer_buffers()
        if len(buffers) != len(state):  # the library re-registers a buffer only in options this codec never sets
            raise RuntimeError(f"the quantizer has {len(buffers)} buffers, the snapshot {len(state)}")
        torch._foreach_copy_(buffers, state)

    # ---- Bookkeeping. The library does three things inside every training forward that make the host wait
    # for the device: it reads each level's k-means init flag, it checks for dead codes (torch.any, .item()),
    # and with quantize dropout it draws the depth on the device, all-reduces it and reads it. This codec
    # decides when they run instead, the same way on every rank with no collective of its own: the init flag
    # is read until the init is done, then no more; expiry runs every `dead_code_every` steps, called by the
    # trainer between steps (the library's own expire_codes_, on the same buffers); the dropout depth comes
    # from a seed the trainer derives from --seed and the step. What is left of the forward compiles whole.

    def _codebooks(self) -> list[nn.Module]:
        return [layer._codebook for layer in self.rvq.layers]

    def _settle_init(self) -> None:
        """Once every level is initialised (k-means on the first batch or `init_codebooks`, or restored from a
        checkpoint), the library's init check becomes a no-op on each level: it read the flag on the host in
        every forward. Until then, one host read per forward."""
        if self._init_settled:
            return
        codebooks = self._codebooks()
        if not bool(torch.stack([c.initted for c in codebooks]).all()):
            return
        for codebook in codebooks:
            codebook.init_embed_ = _init_done
        self._init_settled = True

    def compiles(self, features: torch.Tensor, dropout_seed: int | None = None) -> bool:
        """Whether a training forward of these features (and dropout seed) would compile now: the first of each
        input shape and dropout depth after compile_training() and the k-means init."""
        if not (self.training and self._compiled_forward is not None and self.init_done()):
            return False
        return (tuple(features.shape), self._dropout_seed(dropout_seed)) not in self._compiled_variants

    def init_done(self) -> bool:
        """Every level's k-means init is done (or restored): the training forward reads no flag any more."""
        self._settle_init()
        return self._init_settled

    def dropout_variants(self) -> list[int | None]:
        """The dropout seeds to compile the training forward for: one per quantize-dropout depth ([None]
        without quantize dropout)."""
        rvq = self.rvq
        if not rvq.quantize_dropout:
            return [None]
        return list(_depth_seeds(rvq.quantize_dropout_cutoff_index, rvq.num_quantizers).values())

    def _dropout_seed(self, seed: int | None) -> int | None:
        """The seed handed to the library's quantize dropout: one that gives the depth `seed` would (the
        library's own rule, random.Random(seed).randrange), taken from one seed per depth, so that a compiled
        forward has one variant per depth rather than one per step."""
        rvq = self.rvq
        if seed is None or not (self.training and rvq.quantize_dropout):
            return None
        depths = range(rvq.quantize_dropout_cutoff_index, rvq.num_quantizers)
        return _depth_seeds(depths.start, depths.stop)[random.Random(seed).randrange(depths.start, depths.stop)]

    def compile_training(self, mode: str = "default", variants: int = 1) -> None:
        """Run the training forward (and so its backward) under torch.compile, one graph per input shape
        (static shapes: one per segment length) and per quantize-dropout depth; `variants`: how many such
        graphs the run may need. mode: "default" (torch.compile's) or "cudagraphs" (CUDA_GRAPH_OPTIONS, on CUDA).
        The eval-mode forward, encode and decode stay eager."""
        needed = variants * (self.rvq.num_quantizers if self.rvq.quantize_dropout else 1)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               needed)
        if mode not in ("default", "cudagraphs"):
            raise ValueError(f"compile mode {mode!r}: default or cudagraphs")
        self._cuda_graphs = mode == "cudagraphs"
        options = CUDA_GRAPH_OPTIONS if self._cuda_graphs else COMPILE_OPTIONS.get(self.feature_mean.device.type)
        # torch.compile takes a mode or options, not both: options alone compile in the default mode
        settings = {"options": options} if options else {}
        self._compiled_forward = torch.compile(self._forward, dynamic=False, **settings)

    @property
    def compiled(self) -> bool:
        return self._compiled_forward is not None

    @torch.no_grad()
    def expire_dead_codes(self, latent: torch.Tensor, codes: torch.Tensor) -> int:
        """The library's dead-code expiry (its `expire_codes_`) on every level that has a dead code: each code
        whose EMA cluster size is below the threshold is re-seeded from this batch's residuals at that level.
        latent, codes: the `latent` and `codes` of the step's training forward (the residual at a level is the
        latent less the codes of the levels before, as in that forward; no encoder runs again here).
        A training-mode call that every rank makes at the same step: the library samples the new codes across
        ranks, and the EMA sizes it reads are alike on every rank. One host read finds the levels with dead
        codes (none: nothing else runs); the library reads each such level twice more. Returns their number."""
        if not self.training:
            raise RuntimeError("expire_dead_codes() is training bookkeeping; call model.train() first")
        threshold = self.config.dead_code_threshold
        if threshold <= 0:
            return 0
        levels = self.rvq.layers
        flags = torch.stack([layer._codebook.cluster_size.lt(threshold).any() for layer in levels])
        weights = 2 ** torch.arange(len(levels), device=flags.device, dtype=torch.float64)
        packed = int((flags * weights).sum().item())  # one host read for every level (exact up to 2^53)
        dead = [bool(packed >> level & 1) for level in range(len(levels))]
        if not any(dead):
            return 0
        residual = self.rvq.project_in(latent.float()).flatten(0, 1)  # [frames, codebook_dim]
        codes = codes.flatten(0, 1)  # [frames, levels]; -1 where dropped out
        for level in range(max(i for i, has_dead in enumerate(dead) if has_dead) + 1):
            codebook = levels[level]._codebook
            # this level's codes as the forward's EMA update left them (the library's get_codes_from_indices,
            # without its einops calls: a third of an expiry's host time on a small codec); 0 where dropped out
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

    def maybe_expire_dead_codes(self, step: int, out: CodecOutput) -> int:
        """`expire_dead_codes` of a training forward's output after every `dead_code_every`-th step (`step`
        counts steps done, from 1)."""
        if self.config.dead_code_threshold <= 0 or step % self.config.dead_code_every:
            return 0
        return self.expire_dead_codes(out.latent, out.codes)

    @torch.no_grad()
    def scale_codebook_(self, level: int, factor: float) -> None:
        """Scale one level's codebook and its EMA sums (the library recomputes the codebook from them): a
        codebook that differs on one rank, for the sync check's fault drill."""
        codebook = self._codebooks()[level]
        codebook.embed_avg.mul_(factor)
        codebook.embed.mul_(factor)

    @torch.no_grad()
    def init_codebooks(self, features: torch.Tensor, batch_frames: int, keep: torch.Tensor | None = None,
                       between=None) -> None:
        """k-means init of every level on a sample of features [B, T, D], larger than one batch, of the crops
        `keep` marks (as in `forward`; the sample keeps its shape, so every rank scales alike).

        A training-mode forward of the quantizer: every rank must call it together (the library's
        k-means and EMA statistics are all-reduced across ranks). The EMA cluster sizes are then
        scaled to what one batch of `batch_frames` gives, so that dead-code expiry works from step one.
        between(): called before each k-means iteration of each level (`kmeans_iters` x levels calls), at the
        same points on every rank; it may raise to abandon the init (the levels after it stay uninitialised).
        """
        if not self.training:
            raise RuntimeError("init_codebooks() runs the quantizer in training mode; call model.train() first")
        codebooks = self._codebooks()
        reduces = [codebook.kmeans_all_reduce_fn for codebook in codebooks]
        if between is not None:
            for codebook, reduce in zip(codebooks, reduces):
                codebook.kmeans_all_reduce_fn = _calling_between(reduce, between)
        dropout, self.rvq.quantize_dropout = self.rvq.quantize_dropout, False  # every level sees the sample
        try:
            self.rvq(self._encode_latent(self._drop_crops(features, keep)))
        finally:
            self.rvq.quantize_dropout = dropout
            for codebook, reduce in zip(codebooks, reduces):
                codebook.kmeans_all_reduce_fn = reduce
        scale = batch_frames / (features.shape[0] * features.shape[1])
        for codebook in self._codebooks():
            codebook.cluster_size.mul_(scale)
            codebook.embed_avg.mul_(scale)
        self._settle_init()

    @torch.no_grad()
    def refit_codebooks(self, utterances: list[torch.Tensor], iters: int, batch_frames: int, all_reduce=None,
                        seed: int = 0, between=None, cut_short=None) -> list[float]:
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
        REFIT_CHUNKs of a pass, on this rank alone; when true the rest is skipped (the sums over ranks are still
        joined), and the next between() must raise: what was computed is not used.
        """
        if self.training:
            raise RuntimeError("refit_codebooks() runs the quantizer in eval mode; call model.eval() first")
        reduce = all_reduce or (lambda t: t)
        s, beam = self.config.downsample, self.config.beam_size
        whole = [u[: len(u) // s * s] for u in utterances if len(u) >= s]
        latent = []
        for u in whole:
            if latent and cut_short is not None and cut_short():
                break
            latent.append(self._encode_latent(u[None])[0])
        latent = torch.cat(latent).float()
        total = reduce(torch.tensor([float(len(latent))], device=latent.device)).item()
        generator = torch.Generator().manual_seed(seed)
        # [frames, sequences, dim]; the levels' own projections are identities in ResidualVQ (each level is
        # built with the codebook dim), so residuals and codes share one space
        residual = self.rvq.project_in(latent)[:, None]
        between = between or (lambda: None)
        errors = []
        for layer in self.rvq.layers:
            codebook = layer._codebook
            means, counts = codebook.embed[0].detach().clone(), None
            for _ in range(iters):
                between()
                means, counts = lloyd_step(residual.flatten(0, 1), means, reduce, cut_short)
                counts = counts.masked_fill(counts < RARE_SHARE * counts.double().mean(), 0)
                split_empty_codes(means, counts, generator)
                if self.config.cosine_codebooks:  # unit codes: the nearest is the most similar, the mean's direction
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
    def encode(self, features: torch.Tensor, num_quantizers: int | None = None,
               lengths: torch.Tensor | None = None, beam_size: int | None = None) -> torch.Tensor:
        """Features [T, D] or [B, T, D] -> codes [T', Q] or [B, T', Q] (int64), T a multiple of the downsample.
        Eval mode only.

        lengths [B]: the frames of each row (multiples of the downsample; default T). A row's codes are those
        of its first lengths[i] frames encoded alone, bit for bit, whatever else is in the batch; past them
        they are -1. beam_size (default: the codec's `beam_size`): the library's beam search over the levels
        keeps that many partial code sequences per frame (1: the nearest code at each level alone); a wider beam
        reconstructs closer at several times the time (benchmarks/README.md). num_quantizers keeps the first
        levels of the full search's codes."""
        if self.training:
            raise RuntimeError("encode() runs the codec in eval mode; call model.eval() first")
        single = features.dim() == 2
        x = features[None] if single else features
        frames, s = x.shape[1], self.config.downsample
        lengths = torch.full((x.shape[0],), frames) if lengths is None else lengths
        lengths = lengths.to(x.device)
        beam_size = self.config.beam_size if beam_size is None else beam_size
        _, codes, _ = self.rvq(self._encode_latent(x, lengths), beam_size=beam_size if beam_size > 1 else None)
        codes = codes[:, : frames // s]
        past_end = torch.arange(codes.shape[1], device=x.device)[:, None] >= (lengths // s)[:, None, None]
        codes = codes.masked_fill(past_end, -1)
        if num_quantizers is not None:
            codes = codes[..., :num_quantizers]
        return codes[0] if single else codes

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [T', q] or [B, T', q] (q <= Q levels) -> features [T, D] or [B, T, D]."""
        single = codes.dim() == 2
        c = codes[None] if single else codes
        missing = self.config.num_quantizers - c.shape[-1]
        if missing > 0:  # absent levels contribute nothing (-1 is the library's "dropped" code)
            c = F.pad(c, (0, missing), value=-1)
        latent = self.rvq.get_output_from_indices(c)
        out = self._decode_latent(latent)
        return out[0] if single else out


def _calling_between(reduce, between):
    """The library's k-means all-reduce with between() before every other call: each of its k-means iterations
    reduces twice (the counts, then the sums), so between() runs before each iteration."""
    calls = itertools.count()

    def reduce_between(tensor):
        if next(calls) % 2 == 0:
            between()
        return reduce(tensor)

    return reduce_between


def lloyd_step(samples: torch.Tensor, means: torch.Tensor, reduce,
               cut_short=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lloyd iteration: [N, d] samples assigned to the nearest of [K, d] means, the sums and counts summed
    over ranks by `reduce` (in place); returns the new means (a code with no sample keeps its old one) and the
    counts [K]. REFIT_CHUNK rows at a time: the library's `kmeans` holds the whole [N, K] distance matrix, in
    several temporaries, which at a refit's million beam residuals is gigabytes each and 4x the time.
    cut_short(): when true, the rows left are skipped (the sums are still reduced)."""
    sums, counts = torch.zeros_like(means), torch.zeros(len(means), dtype=torch.long, device=means.device)
    norms = (means * means).sum(-1)
    for chunk in samples.split(REFIT_CHUNK):
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
    for chunk in residual.split(max(1, REFIT_CHUNK // residual.shape[1])):
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


def _init_done(data, mask=None) -> None:
    """A level's k-means init, once it is done: nothing to check (the library's reads its flag on the host)."""


@functools.cache
def _depth_seeds(first: int, stop: int) -> dict[int, int]:
    """For each quantize-dropout depth in range(first, stop), the smallest seed from which the library's rule
    (random.Random(seed).randrange(first, stop)) draws it."""
    seeds, seed = {}, 0
    while len(seeds) < stop - first:
        seeds.setdefault(random.Random(seed).randrange(first, stop), seed)
        seed += 1
    return seeds


def dead_code_counts(model: RVQCodec) -> list[int]:
    """Per level, the codes whose EMA cluster size is at or below the dead-code threshold: the library
    re-seeds a code whose size falls below it (with size = threshold), so these are the codes expired at
    the last steps that have not won frames since. The EMA is synced across ranks: every rank agrees."""
    threshold = model.config.dead_code_threshold
    return [int((layer._codebook.cluster_size[0] <= threshold).sum()) for layer in model.rvq.layers]


def codebook_tensors(model: RVQCodec) -> list[torch.Tensor]:
    """The codebook of every level, [codebook_size, codebook_dim] each."""
    return [layer._codebook.embed[0] for layer in model.rvq.layers]
