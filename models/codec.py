"""The RVQ codec: conv encoder -> vector_quantize_pytorch.ResidualVQ -> conv decoder.

Features are standardised with per-dimension statistics of the training data,
kept as buffers so that `encode` and `decode` work from a checkpoint alone.
The forward pass returns the reconstruction, the codes and the loss terms,
nothing larger, so nothing big can be gathered or reduced by mistake.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from vector_quantize_pytorch import ResidualVQ

from models.codebook_ops import beam_score_weights, calling_between, expire_dead_codes, init_done, refit_codebooks
from models.compiled_step import compile_step, dropout_seed

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


MIN_ENCODE_STEPS = 16  # code frames: the shortest pass RVQCodec.encode runs (shorter inputs are zero-padded)
# On a CPU, encode hands the quantizer a pass's code frames in parts of about this many one-hot entries each
# (frames x beam x beam x codes): the library's beam search builds a one-hot of its candidates at every level, and
# slows down once that outgrows the caches (benchmarks/README.md, "Encoding speed"). On a GPU one call takes them all.
CPU_ONE_HOT_ENTRIES = 1 << 21


class CodecOutput(NamedTuple):
    reconstruction: torch.Tensor  # [B, T, D], in feature space
    codes: torch.Tensor  # [B, T / downsample, Q], -1 where dropped out
    recon_loss: torch.Tensor  # MSE, standardised, each dim weighted by its variance when recon_space="feature"
    commit_loss: torch.Tensor  # summed over levels
    loss: torch.Tensor
    latent: torch.Tensor  # [B, T / downsample, latent_dim]: the quantizer's input, detached (expire_dead_codes)


class Conv1d(nn.Conv1d):
    """nn.Conv1d whose inference on the CPU always runs oneDNN's kernel, with stride 1. PyTorch otherwise picks
    oneDNN or its own kernel by the input's batch size and length, and the two round differently: an utterance's
    codes would depend on the batch it is encoded in. oneDNN's strided kernel varies its rounding with the batch
    size and length too (stride 4 on an AVX2 AMD EPYC), so the downsampling conv (kernel 2 x stride) runs as the
    stride-1 conv it equals on `stride` frames folded into the channels (`folded_conv`). Training (autograd) keeps
    PyTorch's choice."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (not self.training and not torch.is_grad_enabled() and input.device.type == "cpu"
                and input.dtype == torch.float32 and self.padding_mode == "zeros" and isinstance(self.padding, tuple)
                and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            stride = self.stride[0]
            if (stride > 1 and self.kernel_size[0] == 2 * stride and self.dilation[0] == 1 and self.groups == 1
                    and input.shape[-1] + 2 * self.padding[0] >= 2 * stride):
                return folded_conv(input, weight, bias, stride, self.padding[0])
            return torch.ops.aten.mkldnn_convolution(input.contiguous(), weight, bias, self.padding, self.stride,
                                                     self.dilation, self.groups)
        return super()._conv_forward(input, weight, bias)


def folded_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int,
                padding: int) -> torch.Tensor:
    """conv1d(x, weight, bias, stride, padding) for a kernel of 2 x stride, x [B, C, T], as oneDNN's stride-1 conv
    of kernel 2 over the padded input's frames folded `stride` at a time into the channels: output frame t reads
    padded frames stride x t ... stride x t + 2 stride - 1, which are folded frames t and t + 1."""
    batch, channels, frames = x.shape
    out = (frames + 2 * padding - 2 * stride) // stride + 1
    x = F.pad(x, (padding, padding + (-(frames + 2 * padding)) % stride))
    x = x.reshape(batch, channels, -1, stride).transpose(2, 3).reshape(batch, channels * stride, -1)
    w = weight.reshape(weight.shape[0], channels, 2, stride).transpose(2, 3).reshape(weight.shape[0], -1, 2)
    y = torch.ops.aten.mkldnn_convolution(x.contiguous(), w.contiguous(), bias, (0,), (1,), (1,), 1)
    return y[..., :out]


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
        self._compiled_step = None  # the training forward under torch.compile (compile_training)
        self._quantizer_buffers = None  # list(self.rvq.buffers()), listed once: walking the modules is host time

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
        more host time per training step (its einx calls) than a whole step of a small codec on a GPU
        (benchmarks/README.md, "Host overhead per step"); a duplicated crop weighs twice in the EMA statistics of
        a step that dropped one."""
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
        if self.training and self._compiled_step is not None and self._init_settled:
            return self._compiled_step(features, keep, seed)
        return self._forward(features, keep, beam_size, seed)

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
            codebook.init_embed_ = init_done
        self._init_settled = True

    def compiles(self, features: torch.Tensor, dropout_seed: int | None = None) -> bool:
        """Whether a training forward of these features (and dropout seed) would compile now: the first of each
        input shape and dropout depth after compile_training() and the k-means init."""
        if not (self.training and self._compiled_step is not None and self.init_done()):
            return False
        return self._compiled_step.compiles(features, self._dropout_seed(dropout_seed))

    def init_done(self) -> bool:
        """Every level's k-means init is done (or restored): the training forward reads no flag any more."""
        self._settle_init()
        return self._init_settled

    def _dropout_seed(self, seed: int | None) -> int | None:
        """The seed handed to the library's quantize dropout in a training forward (models/compiled_step.py,
        `dropout_seed`); None without quantize dropout."""
        if seed is None or not (self.training and self.rvq.quantize_dropout):
            return None
        return dropout_seed(self.rvq, seed)

    def compile_training(self, mode: str = "default", variants: int = 1) -> None:
        """Run the training forward (and so its backward) under torch.compile (models/compiled_step.py,
        `compile_step`): one graph per input shape and quantize-dropout depth; `variants`: how many input shapes
        the run may need; mode: "default" or "cudagraphs". The eval-mode forward, encode and decode stay eager."""
        self._compiled_step = compile_step(self, self._forward, mode, variants)

    @torch.no_grad()
    def expire_dead_codes(self, latent: torch.Tensor, codes: torch.Tensor) -> int:
        """The library's dead-code expiry on every level that has a dead code (models/codebook_ops.py,
        `expire_dead_codes`); a training-mode call that every rank makes at the same step. Returns the levels."""
        return expire_dead_codes(self, latent, codes)

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
                codebook.kmeans_all_reduce_fn = calling_between(reduce, between)
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

    def refit_codebooks(self, utterances: list[torch.Tensor], iters: int, batch_frames: int, all_reduce=None,
                        seed: int = 0, between=None, cut_short=None) -> list[float]:
        """Residual k-means of every level over the latents of whole training utterances, for the beam search
        that encodes (models/codebook_ops.py, `refit_codebooks`): every rank calls it together, in eval mode.
        Returns the mean squared residual per latent dimension after each level."""
        return refit_codebooks(self, utterances, iters, batch_frames, all_reduce, seed, between, cut_short)


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
        self._settle_init()  # a trained codec's levels are initialised: no host read of their flags per pass
        single = features.dim() == 2
        x = features[None] if single else features
        frames, s = x.shape[1], self.config.downsample
        lengths = torch.full((x.shape[0],), frames) if lengths is None else lengths
        lengths = lengths.to(x.device)
        beam_size = self.config.beam_size if beam_size is None else beam_size
        codes = self._quantize(self._encode_latent(x, lengths), beam_size)[:, : frames // s]
        past_end = torch.arange(codes.shape[1], device=x.device)[:, None] >= (lengths // s)[:, None, None]
        codes = codes.masked_fill(past_end, -1)
        if num_quantizers is not None:
            codes = codes[..., :num_quantizers]
        return codes[0] if single else codes

    def _quantize(self, latent: torch.Tensor, beam_size: int) -> torch.Tensor:
        """[B, T', C] latents -> [B, T', Q] codes of the library's search (beam 1: the nearest code at each level).
        The quantizer codes each frame on its own, so on a CPU the frames go in parts of nearly equal size, none
        over CPU_ONE_HOT_ENTRIES of one-hot: the same codes (tests/test_codec.py), in less time."""
        rows = latent.reshape(1, -1, latent.shape[-1])
        parts = 1
        if latent.device.type == "cpu":
            per_part = max(1, CPU_ONE_HOT_ENTRIES // (beam_size * beam_size * self.config.codebook_size))
            parts = max(1, -(-rows.shape[1] // per_part))
        codes = [self.rvq(part, beam_size=beam_size if beam_size > 1 else None)[1]
                 for part in rows.tensor_split(parts, dim=1)]
        return torch.cat(codes, dim=1).reshape(*latent.shape[:2], -1)

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
