"""w2v-BERT's relative-position self-attention without a T x T table.

transformers' Wav2Vec2BertSelfAttention with `position_embeddings_type="relative_key"` (w2v-BERT 2.0:
left 64, right 8) adds to the scaled scores q_i . k_j the bias `scaling * q_i . E[clamp(j - i, -left, right)]`,
built as an einsum over a [T, T, head_dim] table of distance embeddings and handed to SDPA as a float
[B, H, T, T] mask. The bias only takes left + right + 1 distinct distances, so this module computes q
against those embeddings once, a [B, H, T, left + right + 1] table, and reads it per (query, key):
- on CUDA, inside flex attention's `score_mod` (compiled), so no T x T tensor ever exists;
- on a CPU, a block of queries at a time: keys near the block (within left/right of one of its queries) get the
  bias gathered from the table into a small mask; every key farther away has the clipped end distance's bias
  for the whole block, which is a dot product with a fixed embedding, so it is folded into the key
  (q . k + q . E = q . (k + E)) and those keys need no mask at all. The two parts are two fused attention calls
  merged by their log-sum-exps;
- on CUDA, or wherever Triton runs, data/audio/w2v_attention_triton.py's kernel: a flash-attention forward that reads
  the bias from the table only in the tiles near the diagonal and adds one value per query row elsewhere;
- transformers' own module ("stock"), kept beside ours with the same weights, so that a measurement can choose it;
- where those kernels are missing (flex attention on an old torch or failing to compile, with a warning; the
  CPU attention that returns its log-sum-exp) or attention dropout is on: the bias gathered into SDPA's mask,
  a block of queries at a time.

`use_fast_attention(model)` puts the module in place of each encoder layer's `self_attn`, sharing the
loaded weights (the state dict keeps its names). Other position types keep transformers' module. The encoder then
hands its layers the [B, T] padding mask as it is (KEY_PADDING): transformers would build a [B, 1, T, T] mask for
SDPA and first read the padding back from the device to see whether it may drop it (a host sync every padded
pass, and no CUDA graph can hold one). Our kernels read only the keys' padding, the same values either way;
transformers' module ("stock") gets the mask transformers' own function builds from it, once a pass.
"""
from __future__ import annotations

import copy
import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from data.audio.w2v_attention_triton import key_tensors, triton_relative_key_attention

log = logging.getLogger(__name__)

RELATIVE_KEY = "relative_key"
KERNELS = ("auto", "stock", "flex", "fold", "gather", "triton")
# The folded CPU path takes this many queries a block: the near keys' mask is rows x (rows + left + right).
FOLD_BLOCK_ROWS = 256
# The gathered path builds the mask for as many queries at a time as fit this many bytes (at least
# MIN_BLOCK_ROWS): a block that stays in cache is faster than one T x T mask, and its memory is bounded.
BIAS_BLOCK_BYTES = 2 << 20
MIN_BLOCK_ROWS = 16


class RelativeKeySelfAttention(nn.Module):
    """Drop-in for a relative_key Wav2Vec2BertSelfAttention: same weights, same outputs, no T x T bias table.

    `kernel`: "auto" (flex attention on CUDA, the folded bias on a CPU), "stock" (transformers' module, kept
    beside this one with the same weights), "flex", "fold", "gather" or "triton". A kernel that cannot run here
    raises when it is used (kernel_available says which can)."""

    def __init__(self, stock: nn.Module, *, kernel: str = "auto"):
        super().__init__()
        if getattr(stock, "position_embeddings_type", None) != RELATIVE_KEY:
            raise ValueError(f"{type(stock).__name__} uses position_embeddings_type "
                             f"{getattr(stock, 'position_embeddings_type', None)!r}, not {RELATIVE_KEY!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, not {kernel!r}")
        self.linear_q, self.linear_k = stock.linear_q, stock.linear_k
        self.linear_v, self.linear_out = stock.linear_v, stock.linear_out
        self.distance_embedding = stock.distance_embedding
        self.dropout = stock.dropout
        self.num_heads, self.head_size, self.scaling = stock.num_heads, stock.head_size, stock.scaling
        self.left = stock.left_max_position_embeddings
        self.right = stock.right_max_position_embeddings
        self.position_embeddings_type = RELATIVE_KEY
        self.kernel = kernel
        self._stock = (stock,)  # a tuple: not a submodule, so the state dict keeps one name per weight
        self._scaled = None  # (the weights' identity, embedding * scaling): _scaled_embedding

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                relative_position_embeddings: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, None]:
        if self.kernel == "stock":
            stock = self._stock[0]
            return stock(hidden_states, attention_mask=stock_mask(stock.config, hidden_states, attention_mask),
                         relative_position_embeddings=relative_position_embeddings, **kwargs)
        batch, length, _ = hidden_states.shape
        shape = (batch, length, self.num_heads, self.head_size)
        q = self.linear_q(hidden_states).view(shape).transpose(1, 2)
        k = self.linear_k(hidden_states).view(shape).transpose(1, 2)
        v = self.linear_v(hidden_states).view(shape).transpose(1, 2)
        embedding = self.distance_embedding.weight.to(q.dtype)  # [left + right + 1, head_size]
        valid = key_padding(attention_mask, batch, length)
        dropout = self.dropout.p if self.training else 0.0
        kernel = self._kernel(q, dropout)
        if kernel == "flex":
            out = flex_relative_key_attention(q, k, v, embedding, valid, self.scaling, self.left, self.right)
        elif kernel == "triton":
            table = torch.matmul(q, self._scaled_embedding(embedding).t())  # distance_table's, the product made once
            out = triton_relative_key_attention(q, k, v, table, pass_keys(attention_mask, valid), self.scaling,
                                                self.left, self.right)
        elif kernel == "fold":
            out = folded_relative_key_attention(q, k, v, embedding, valid, self.scaling, self.left, self.right)
        else:
            out = gathered_relative_key_attention(q, k, v, distance_table(q, embedding, self.scaling), valid,
                                                  self.scaling, self.left, self.right, dropout=dropout)
        out = self.linear_out(out.transpose(1, 2).reshape(batch, length, -1))
        return out, None

    def _scaled_embedding(self, embedding: torch.Tensor) -> torch.Tensor:
        """`embedding * scaling` (distance_table's), made once for these weights in this dtype: one op a layer less in
        every pass. Made afresh under autograd or a compiler, which should see the product."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return embedding * self.scaling
        weight = self.distance_embedding.weight
        key = (weight.data_ptr(), weight._version, embedding.dtype, embedding.device)
        if self._scaled is None or self._scaled[0] != key:
            self._scaled = (key, embedding * self.scaling)
        return self._scaled[1]

    def _kernel(self, q: torch.Tensor, dropout: float) -> str:
        if dropout > 0:  # only SDPA's mask path applies attention dropout
            return "gather"
        if self.kernel != "auto":
            return self.kernel
        if torch.compiler.is_compiling():  # the encoder compiled (--compile): the gathered bias traces on any
            return "gather"  # device; flex attention inside it failed to compile on an H100 (benchmarks/README.md)
        if q.is_cuda:
            return "flex" if compiled_flex_attention() is not None else "gather"
        return "fold" if _cpu_attention_with_lse() is not None else "gather"


# the Triton kernel's key tensors of the last pass's mask: (a weak reference to the encoder's mask, the tensors),
# replaced as a whole, so that threads running passes of their own never read another pass's
_PASS_KEYS: tuple = (lambda: None, None)


def pass_keys(mask: torch.Tensor | None, valid: torch.Tensor | None):
    """The Triton kernel's key tensors (data/audio/w2v_attention_triton.py key_tensors) of `valid`, the keys of the
    encoder's `mask`: made once a pass, as every layer of a pass gets the same mask object. None for no padding."""
    if valid is None:
        return None
    if mask is None or torch.compiler.is_compiling():
        return key_tensors(valid)
    global _PASS_KEYS
    ref, keys = _PASS_KEYS
    if ref() is mask:
        return keys
    keys = key_tensors(valid)
    _PASS_KEYS = (weakref.ref(mask), keys)
    return keys


# how an encoder whose layers are ours hands them its padding mask: the [B, T] mask itself (module doc)
KEY_PADDING = "rvq_key_padding"


def _padding_as_is(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask interface for KEY_PADDING: the [B, T] bool padding mask as the encoder gave it (None: no
    padding)."""
    return attention_mask


def _hand_padding_as_is(model: nn.Module) -> None:
    """Make `model`'s encoder hand its layers the [B, T] padding mask (KEY_PADDING), on a config of its own, where this
    transformers builds masks through its mask interface (the encoder's create_bidirectional_mask; elsewhere the
    encoder keeps its masks, which our attention reads too). Nothing else reads the encoder's config: the layers'
    modules keep the model's."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.models.wav2vec2_bert import modeling_wav2vec2_bert
    except ImportError:
        return
    if not hasattr(modeling_wav2vec2_bert, "create_bidirectional_mask") or \
            not hasattr(ALL_MASK_ATTENTION_FUNCTIONS, "register"):
        return
    if KEY_PADDING not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(KEY_PADDING, _padding_as_is)
    encoder = model.encoder
    encoder.config = copy.copy(encoder.config)
    encoder.config._attn_implementation = KEY_PADDING


# transformers' mask of the last pass's [B, T] padding mask, for its module: (a weak reference to the padding
# mask, the mask built), replaced as a whole (as _PASS_KEYS)
_STOCK_MASK: tuple = (lambda: None, None)


def stock_mask(config, hidden_states: torch.Tensor, mask: torch.Tensor | None):
    """The mask transformers' attention module takes, from the one its encoder gave: a [B, T] padding mask (KEY_PADDING)
    goes through transformers' own create_bidirectional_mask with the module's config, once a pass (every layer of
    a pass gets the same mask object); another mask as it is."""
    if mask is None or mask.dim() != 2:
        return mask
    from transformers.masking_utils import create_bidirectional_mask

    global _STOCK_MASK
    ref, built = _STOCK_MASK
    if ref() is mask:
        return built
    built = create_bidirectional_mask(config=config, inputs_embeds=hidden_states, attention_mask=mask)
    _STOCK_MASK = (weakref.ref(mask), built)
    return built


def distance_table(q: torch.Tensor, embedding: torch.Tensor, scaling: float) -> torch.Tensor:
    """[B, H, T, left + right + 1]: the bias of query i towards any key at clipped distance d is table[..., i, d]."""
    return torch.matmul(q, (embedding * scaling).t())  # scaling the embeddings, not the [B, H, T, 73] product


def key_padding(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """[B, T] bool, True for keys that may be attended, from the mask the encoder passes its layers (None: all).

    The encoder's mask is a padding mask: 2D [B, T] (1 = a frame), or 4D [B, 1, T, T] that depends on the key
    alone, boolean (True = attend, transformers 5) or additive float (0 or the dtype's minimum, 4.x); its first
    query row holds the padding of every row."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{RELATIVE_KEY} attention takes a padding mask tensor, not {type(mask).__name__}: load the "
                        "model with attn_implementation 'sdpa' or 'eager'")
    if mask.dim() == 4:
        mask = mask[:, 0, 0, :]
        if mask.is_floating_point():
            mask = mask > torch.finfo(mask.dtype).min / 2
    elif mask.dim() != 2:
        raise ValueError(f"expected a [B, T] or [B, 1, T, T] attention mask, got shape {tuple(mask.shape)}")
    return mask.to(torch.bool).expand(batch, length)


@functools.lru_cache(maxsize=8)
def _distance_index(rows: int, columns: int, offset: int, left: int, right: int,
                    device: torch.device) -> torch.Tensor:
    """[rows, columns] int64: the table column of the clipped distance c - offset - r, for query row r and key
    column c."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(columns, device=device)[None, :]
    return (c - offset - r).clamp_(-left, right).add_(left)


def gathered_relative_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                    valid: torch.Tensor | None, scaling: float, left: int, right: int, *,
                                    dropout: float = 0.0, block_bytes: int = BIAS_BLOCK_BYTES) -> torch.Tensor:
    """SDPA with the relative-position bias gathered from `table` into its float mask, a block of queries at a
    time (the mask of one block is all that exists at once). Masked keys score the dtype's minimum, as in
    transformers' model."""
    batch, heads, length, _ = q.shape
    rows = min(length, max(MIN_BLOCK_ROWS, block_bytes // (batch * heads * length * q.element_size())))
    # columns length - 1 - start + j: query start + r and key j, for any block start
    window = _distance_index(rows, 2 * length - 1, length - 1, left, right, q.device)
    padding = None if valid is None else ~valid[:, None, None, :]
    blocks = []
    for start in range(0, length, rows):
        stop = min(start + rows, length)
        index = window[: stop - start, length - 1 - start: 2 * length - 1 - start]
        bias = table[:, :, start:stop].gather(-1, index.expand(batch, heads, stop - start, length))
        if padding is not None:
            bias.masked_fill_(padding, torch.finfo(bias.dtype).min)
        blocks.append(F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=bias,
                                                     dropout_p=dropout, scale=scaling))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


@functools.cache
def _cpu_attention_with_lse():
    """The fused CPU attention that also returns each query's log-sum-exp (aten's flash kernel), if this torch
    has it and it takes a float mask broadcast over heads and queries; None otherwise."""
    attend = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if attend is None:
        return None
    q, k, v = torch.linspace(-1, 1, 72).view(3, 1, 1, 3, 8).unbind(0)
    mask = torch.tensor([[[[0.0, -1.0, torch.finfo(torch.float32).min]]]])
    try:
        out, lse = attend(q, k, v, attn_mask=mask, scale=0.5)[:2]
    except Exception:  # noqa: BLE001 - an older signature: the gathered path serves
        return None
    scores = (q @ k.transpose(-1, -2)) * 0.5 + mask
    exact = torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5) and \
        torch.allclose(lse, scores.logsumexp(-1), atol=1e-5)
    return attend if exact else None


def folded_relative_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, embedding: torch.Tensor,
                                  valid: torch.Tensor | None, scaling: float, left: int, right: int, *,
                                  rows: int = FOLD_BLOCK_ROWS) -> torch.Tensor:
    """Exact relative_key attention on a CPU, a block of `rows` queries at a time, no T x T tensor.

    For queries [i0, i1), keys [i0 - left, i1 + right) are near: their bias is gathered from the distance table
    into a [rows, rows + left + right] mask. A key j < i0 - left is at clipped distance -left from every query of
    the block and a key j >= i1 + right at +right, so its bias scaling * q . E[end] is folded into the key
    (k + E[end]) and the far keys run unmasked but for padding. Softmax over the union = the two partial softmaxes
    weighted by their log-sum-exps. Masked keys score the dtype's minimum, as in transformers' model."""
    attend = _cpu_attention_with_lse()
    batch, heads, length, _ = q.shape
    table = distance_table(q, embedding, scaling)
    far_left, far_right = k + embedding[0], k + embedding[-1]
    padding = None
    if valid is not None and not bool(valid.all()):
        padding = q.new_zeros(batch, 1, 1, length).masked_fill_(~valid[:, None, None, :], torch.finfo(q.dtype).min)
    # column c: query i0 + r and key i0 - left + c, for any block start i0
    near = _distance_index(rows, rows + left + right, left, left, right, q.device)
    blocks = []
    for start in range(0, length, rows):
        stop = min(start + rows, length)
        lo, hi = max(start - left, 0), min(stop + right, length)
        index = near[: stop - start, lo - (start - left): hi - (start - left)]
        bias = table[:, :, start:stop].gather(-1, index.expand(batch, heads, stop - start, hi - lo))
        if padding is not None:
            bias = bias + padding[..., lo:hi]
        block_q = q[:, :, start:stop]
        out, near_lse = attend(block_q, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=bias, scale=scaling)[:2]
        if lo > 0 or hi < length:
            far_k = torch.cat([far_left[:, :, :lo], far_right[:, :, hi:]], dim=2)
            far_v = torch.cat([v[:, :, :lo], v[:, :, hi:]], dim=2)
            far_mask = None if padding is None else torch.cat([padding[..., :lo], padding[..., hi:]], dim=-1)
            far, far_lse = attend(block_q, far_k, far_v, attn_mask=far_mask, scale=scaling)[:2]
            share = torch.sigmoid(far_lse - near_lse).unsqueeze(-1)  # the far keys' share of the softmax mass
            out = torch.lerp(out.float(), far.float(), share).to(q.dtype)
        blocks.append(out)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def flex_relative_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, embedding: torch.Tensor,
                                valid: torch.Tensor | None, scaling: float, left: int, right: int) -> torch.Tensor:
    """Flex attention whose score_mod adds table[b, h, i, clamp(j - i) + left] and drops padded keys: the bias is
    read inside the kernel, never materialised. Compiled on CUDA once a probe has proven it (flex_proven); the
    gathered bias, exact, where it is not, with a warning; eager elsewhere."""
    table = distance_table(q, embedding, scaling)
    score_mod = relative_key_score_mod(table, valid, left, right)
    if torch.compiler.is_compiling() or not q.is_cuda:  # inside a compiled model the outer compile traces flex
        from torch.nn.attention.flex_attention import flex_attention  # attention itself; elsewhere it runs eagerly
        return flex_attention(q, k, v, score_mod=score_mod, scale=scaling)
    kernel = compiled_flex_attention()
    if kernel is not None and flex_proven(kernel, q, embedding, valid is not None, scaling, left, right):
        try:
            return kernel(q, k, v, score_mod=score_mod, scale=scaling)
        except Exception as e:  # noqa: BLE001 - a shape the probe did not cover failed to compile: stay exact
            give_up_flex(e)
    return gathered_relative_key_attention(q, k, v, table, valid, scaling, left, right)


def relative_key_score_mod(table: torch.Tensor, valid: torch.Tensor | None, left: int, right: int):
    """flex attention's score_mod for the bias in `table` ([B, H, T, left + right + 1]) and the keys `valid`
    ([B, T] bool or None). One code object for every call, so that compiled graphs are reused."""
    def score_mod(score, b, h, q_idx, kv_idx):
        biased = score + table[b, h, q_idx, torch.clamp(kv_idx - q_idx, -left, right) + left]
        if valid is None:
            return biased
        return torch.where(valid[b, kv_idx], biased, float("-inf"))

    return score_mod


# shapes (rows, frames) the probe runs: a first shape compiles a static graph, a second of other sizes the dynamic
# one every later pass reuses, one row the graph of a single-row pass (a size of 1 is compiled on its own)
PROBE_SHAPES = ((2, 96), (3, 130), (1, 160))
# the probe's largest error against the gathered bias, relative to the output's largest value, by dtype
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
_FLEX_STATE: dict = {"kernel": None, "failed": False, "proven": set()}


def flex_proven(kernel, q: torch.Tensor, embedding: torch.Tensor, padded: bool, scaling: float, left: int,
                right: int) -> bool:
    """Whether compiled flex attention computes this layout's attention (q's dtype, heads, head size and device):
    before its first use, a probe compiles every graph later passes need (PROBE_SHAPES) on random inputs and
    checks each output against the gathered bias. Decided once per process and layout, before any pass, so that
    every pass of a run, and of a resumed one, takes the same kernel. False (flex given up, with a warning) where
    any of it fails."""
    if _FLEX_STATE["failed"]:
        return False
    key = (q.dtype, q.shape[1], q.shape[3], q.device, padded, scaling, left, right)
    if key in _FLEX_STATE["proven"]:
        return True
    generator = torch.Generator(device=q.device).manual_seed(0)
    try:
        for rows, frames in PROBE_SHAPES:
            x = torch.randn(3, rows, q.shape[1], frames, q.shape[3], generator=generator, device=q.device,
                            dtype=torch.float32).to(q.dtype)
            valid = None
            if padded:
                valid = torch.ones(rows, frames, dtype=torch.bool, device=q.device)
                valid[-1, frames - frames // 3:] = False
            table = distance_table(x[0], embedding, scaling)
            got = kernel(x[0], x[1], x[2], score_mod=relative_key_score_mod(table, valid, left, right), scale=scaling)
            want = gathered_relative_key_attention(x[0], x[1], x[2], table, valid, scaling, left, right)
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if not error <= PROBE_TOLERANCE.get(q.dtype, 2e-2):
                raise ArithmeticError(f"{rows} x {frames} frames differ from the gathered bias by {error:.1e} "
                                      "relative")
    except Exception as e:  # noqa: BLE001 - any failure leaves the exact gathered path
        give_up_flex(e)
        return False
    _FLEX_STATE["proven"].add(key)
    return True


def give_up_flex(error: Exception) -> None:
    """Compiled flex attention failed: the rest of the process uses the gathered bias (exact, slower)."""
    message = str(error).strip().splitlines()
    log.warning("flex attention failed (%s: %s); w2v-BERT attention falls back to a gathered bias, exact but "
                "slower", type(error).__name__, " | ".join(message[-3:])[:500] if message else "")
    _FLEX_STATE["kernel"], _FLEX_STATE["failed"] = None, True


def compiled_flex_attention():
    """torch.compile(flex_attention), made once; None where this torch has no flex attention or it failed."""
    if _FLEX_STATE["failed"]:
        return None
    if _FLEX_STATE["kernel"] is None:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            _FLEX_STATE["kernel"] = torch.compile(flex_attention)
        except Exception as e:  # noqa: BLE001 - an old torch or a broken compiler: the exact gathered path
            log.warning("flex attention is unavailable (%s: %s); w2v-BERT attention uses a gathered bias, exact "
                        "but slower", type(e).__name__, e)
            _FLEX_STATE["failed"] = True
            return None
    return _FLEX_STATE["kernel"]


def use_fast_attention(model: nn.Module, *, kernel: str = "auto") -> int:
    """Put RelativeKeySelfAttention in place of every relative_key self-attention of a Wav2Vec2BertModel's
    encoder, in place, sharing its weights; the number replaced (0 for other position types, whose stock
    module stays)."""
    config = model.config
    if getattr(config, "position_embeddings_type", None) != RELATIVE_KEY:
        return 0
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "eager", "sdpa"):
        log.info("w2v-BERT keeps transformers' attention: attn_implementation %r passes no padding tensor",
                 implementation)
        return 0
    replaced = 0
    for layer in model.encoder.layers:
        if getattr(layer.self_attn, "position_embeddings_type", None) == RELATIVE_KEY and \
                not isinstance(layer.self_attn, RelativeKeySelfAttention):
            layer.self_attn = RelativeKeySelfAttention(layer.self_attn, kernel=kernel)
            replaced += 1
    if replaced and all(isinstance(layer.self_attn, RelativeKeySelfAttention) for layer in model.encoder.layers):
        _hand_padding_as_is(model)
    return replaced
