"""w2v-BERT's relative-position attention as one Triton kernel: a flash-attention forward that adds the bias itself.

Query i adds to its score against key j `table[i, clamp(j - i, -left, right) + left]` (data/audio/w2v_attention.py
distance_table: scaling * q_i . E[d], [B, H, T, left + right + 1]). A block of BLOCK_M queries walks the keys in
three stages:
- the tiles left of the band (every key at least `left` before every query of the block): one value per query
  row, table[i, 0];
- the band's few tiles: the bias read from the table, one distance per (query, key);
- the tiles right of the band: table[i, left + right].
So the bias costs a load per element only near the diagonal, and no [T, T] tensor exists anywhere. Padded keys
(the [B, T] mask the encoder passes) score -inf; tiles past a row's last valid key are not visited. The output is
written straight into [B, T, H, D], the layout the output projection reads.

Runs where Triton runs: on CUDA, and on a CPU under TRITON_INTERPRET=1 (how the tests check it).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a machine without Triton: data/audio/w2v_attention.py keeps its other kernels
    triton = None

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by whether the scores are exact float32 (IEEE products, twice the
# registers of a bfloat16 tile). Fixed, not autotuned: the tiles decide the summation order, so the last bits,
# and a shard's bits must not depend on a timing.
TILES = {False: (128, 64, 4, 3), True: (64, 32, 4, 2)}
LOG2E = 1.4426950408889634


def triton_available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: Triton importable and a CUDA device, or a CPU under
    TRITON_INTERPRET=1."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def key_tensors(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's form of [B, T] bool valid keys: int8 [B, T] with a unit last stride, and one past each row's last
    valid key (int32 [B]: the tiles after it hold only padding). The same for every layer of a pass: made once
    (data/audio/w2v_attention.py pass_keys)."""
    valid_keys = valid.to(torch.int8)
    if valid_keys.stride(-1) != 1:
        valid_keys = valid_keys.contiguous()
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device, dtype=torch.int32)
    return valid_keys, (valid_keys.to(torch.int32) * positions).amax(dim=1).to(torch.int32)


def triton_relative_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                  valid: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, scaling: float,
                                  left: int, right: int) -> torch.Tensor:
    """[B, H, T, D] q, k, v (any strides with a unit last one, as `linear(x).view(...).transpose(1, 2)` gives),
    the [B, H, T, left + right + 1] bias table, the [B, T] bool valid keys (or their key_tensors) or None ->
    [B, H, T, D], a view of [B, T, H, D] memory (so that `.transpose(1, 2).reshape(B, T, H * D)` copies nothing)."""
    batch, heads, length, head = q.shape
    out = torch.empty(batch, length, heads, head, dtype=q.dtype, device=q.device)
    if length == 0 or batch == 0:
        return out.transpose(1, 2)
    ieee = q.dtype == torch.float32
    block_m, block_n, warps, stages = TILES[ieee]
    table = table if table.stride(-1) == 1 else table.contiguous()
    if valid is None:
        valid_keys = key_end = table  # not read (HAS_VALID is off); any tensor serves as the pointer
        valid_stride = 0
    else:
        valid_keys, key_end = valid if isinstance(valid, tuple) else key_tensors(valid)
        valid_stride = valid_keys.stride(0)
    grid = (triton.cdiv(length, block_m), batch * heads)
    _relative_key_attention[grid](
        q, k, v, table, valid_keys, key_end, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), table.stride(0), table.stride(1), table.stride(2),
        out.stride(0), out.stride(2), out.stride(1), valid_stride,
        heads, length, head, float(scaling) * LOG2E,
        LEFT=left, RIGHT=right, HEAD=_power_of_two(head), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_VALID=valid is not None, IEEE=ieee, EVEN_HEAD=_power_of_two(head) == head, num_warps=warps,
        num_stages=stages)
    return out.transpose(1, 2)


def _power_of_two(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


if triton is not None:
    @triton.jit
    def _rows_mask(rows_ok, d_ok, EVEN_HEAD: tl.constexpr):
        """The mask of a [rows, HEAD] load or store: the rows alone where the head fills HEAD, so that it is constant
        along a row and the access stays vectorised (and asynchronous copies can pipeline it)."""
        if EVEN_HEAD:
            return rows_ok[:, None]
        else:
            return rows_ok[:, None] & d_ok[None, :]

    @triton.jit
    def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_rows, bias_row, valid_base, stride_kt, stride_vt,
                      offs_m, offs_d, rows_ok, d_ok, length, scale_log2, first, stop,
                      STAGE: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_VALID: tl.constexpr, IEEE: tl.constexpr, EVEN_HEAD: tl.constexpr):
        """The online softmax over key tiles [first, stop): STAGE 1 and 3 add one bias per row (`bias_row`), STAGE
        2 reads each (query, key)'s from the table."""
        for start_n in range(first, stop, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keys_ok = offs_n < length
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                        mask=_rows_mask(keys_ok, d_ok, EVEN_HEAD), other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if STAGE == 2:
                distance = tl.minimum(tl.maximum(offs_n[None, :] - offs_m[:, None], -LEFT), RIGHT) + LEFT
                bias = tl.load(table_rows[:, None] + distance, mask=rows_ok[:, None], other=0.0).to(tl.float32)
                s = s * scale_log2 + bias * 1.4426950408889634
            else:
                s = s * scale_log2 + bias_row[:, None]
            if HAS_VALID:
                keys_ok = keys_ok & (tl.load(valid_base + offs_n, mask=keys_ok, other=0) != 0)
            s = tl.where(keys_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                        mask=_rows_mask(keys_ok, d_ok, EVEN_HEAD), other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _relative_key_attention(Q, K, V, TABLE, VALID, KEY_END, OUT,
                                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                                stride_vb, stride_vh, stride_vt, stride_tb, stride_th, stride_tt,
                                stride_ob, stride_oh, stride_ot, stride_valid,
                                heads, length, head, scale_log2,
                                LEFT: tl.constexpr, RIGHT: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr,
                                EVEN_HEAD: tl.constexpr):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD)
        rows_ok = offs_m < length
        d_ok = offs_d < head
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                    mask=_rows_mask(rows_ok, d_ok, EVEN_HEAD), other=0.0)
        table_rows = TABLE + b * stride_tb + h * stride_th + offs_m * stride_tt
        far_left = tl.load(table_rows, mask=rows_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        far_right = tl.load(table_rows + LEFT + RIGHT, mask=rows_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        valid_base = VALID + b * stride_valid
        key_end = length
        if HAS_VALID:
            key_end = tl.load(KEY_END + b)
        # the band: the tiles holding keys start_m - LEFT .. start_m + BLOCK_M - 1 + RIGHT
        band_first = tl.maximum(start_m - LEFT, 0) // BLOCK_N * BLOCK_N
        band_stop = (start_m + BLOCK_M - 1 + RIGHT) // BLOCK_N * BLOCK_N + BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_rows, far_left, valid_base,
                                      stride_kt, stride_vt, offs_m, offs_d, rows_ok, d_ok, length, scale_log2,
                                      0, tl.minimum(band_first, key_end), 1, LEFT, RIGHT, BLOCK_N, HAS_VALID, IEEE,
                                      EVEN_HEAD)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_rows, far_left, valid_base,
                                      stride_kt, stride_vt, offs_m, offs_d, rows_ok, d_ok, length, scale_log2,
                                      band_first, tl.minimum(band_stop, key_end), 2, LEFT, RIGHT, BLOCK_N, HAS_VALID,
                                      IEEE, EVEN_HEAD)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_rows, far_right, valid_base,
                                      stride_kt, stride_vt, offs_m, offs_d, rows_ok, d_ok, length, scale_log2,
                                      band_stop, key_end, 3, LEFT, RIGHT, BLOCK_N, HAS_VALID, IEEE,
                                      EVEN_HEAD)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row whose every key is padding: zeros, not 0 / 0
        out = acc / l_i[:, None]
        tl.store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=_rows_mask(rows_ok, d_ok, EVEN_HEAD))
