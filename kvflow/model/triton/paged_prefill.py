"""Prompt and mixed attention over the flattened batch: varlen queries, every key read through
the block table (this step's own K/V are written to the cache first, so earlier context and
new tokens are one stream of keys).

Sequence i owns query rows query_start_loc[i] .. query_start_loc[i + 1] - 1, sitting at
positions seq_lens[i] - query_len .. seq_lens[i] - 1; row r sees keys 0..its position (causal
within the new tokens, all of the earlier context), fewer under a sliding window. A decode is a
sequence with one query row, so one launch serves a mixed step. Grid (sequence, head, query
tile); a tile past its sequence's rows does nothing. Attention sinks (one logit per query head,
a key whose value is zero) join each row's softmax at the end, as one more fold."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_geometry, hadamard_rotate, rotates
from kvflow.model.triton.layout import (key_offset, kv_kind, kv_operands, load_kv, soft_cap,
                                        tile_base, value_offset)


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc, out_ptr,
                    sinks_ptr, scale, cap, window, k_fp8_scale, v_fp8_scale, stride_q_tok, stride_q_head,
                    stride_o_tok, stride_o_head, stride_bt,
                    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, KV_KIND: tl.constexpr,
                    HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < q_len
    pos = context + r
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (q_start + r).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # keys this tile's rows can see: up to its last row's position, from its first row's window
    hi = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + tile * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        block = tl.load(block_tables + seq.to(tl.int64) * stride_bt + t // BLOCK_SIZE, mask=t_ok, other=0)
        base = tile_base(block, kv_head, KV_HEADS, BLOCK_SIZE, HEAD_DIM, KV_KIND)[:, None]
        at = (t % BLOCK_SIZE)[:, None]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = load_kv(k_cache, k_scales, k_fp8_scale, base, key_offset(at, d[None, :], BLOCK_SIZE), at, kv_mask,
                    t_ok[:, None], KV_KIND, BLOCK_SIZE, HEAD_DIM)
        v = load_kv(v_cache, v_scales, v_fp8_scale, base, value_offset(at, d[None, :], HEAD_DIM), at, kv_mask,
                    t_ok[:, None], KV_KIND, BLOCK_SIZE, HEAD_DIM)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale  # [M, N]
        if USE_CAP:
            s = soft_cap(s, cap)
        seen = t_ok[None, :] & (t[None, :] <= pos[:, None])
        if USE_WINDOW:
            seen = seen & (pos[:, None] - t[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m = m_new

    if HAS_SINKS:  # one more key, of value zero: the sum and outputs taken to the max with it
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_sink = tl.maximum(m, sink)
        alpha = tl.exp(m - m_sink)
        l = l * alpha + tl.exp(sink - m_sink)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, scale: float, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  out: torch.Tensor | None = None, block_m: int = 32,
                  block_n: int = 32, kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the flat q [T, H, D] (sequence i's rows from query_start_loc[i], i in
    0..N-1) over each sequence's cached keys through block_tables [N, max_blocks]; the new
    tokens' K/V must already be in the cache. Returns out [T, H, D] in q's dtype. `kv_scales`:
    an fp8 cache's (k_scale, v_scale); `sinks`: fp32 [H], each query head's attention-sink
    logit (None: none)."""
    num_tokens, heads, head_dim = q.shape
    block_size, kv_heads, cache_dim = cache_geometry(k_cache)
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q has {heads} heads of {head_dim}; the cache {kv_heads} of {cache_dim}")
    if q.stride(2) != 1:
        raise ValueError("q's head dim must be dense")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # fp32 stays fp32 in the dots (tf32 would drift from the reference); bf16 is bf16 anyway.
    # Triton's interpreter (CPU tensors) gets bf16 dots wrong: there they run in fp32.
    dot_fp32 = q.device.type == "cpu" or q.dtype == torch.float32
    precision = "ieee" if dot_fp32 else "tf32"
    rotated = rotates(k_cache)  # rotated keys and values: q rotated alike, out back
    if rotated:
        q, final = hadamard_rotate(q).to(q.dtype), out
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    (kc, ks), (vc, vs) = kv_operands(k_cache), kv_operands(v_cache)
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    _prefill_kernel[(num_seqs, heads, triton.cdiv(max_query_len, block_m))](
        q, kc, vc, ks, vs, block_tables, seq_lens, query_start_loc, out,
        seq_lens if sinks is None else sinks, scale, float(logits_soft_cap or 0.0), int(sliding_window or 0),
        float(kv_scales[0]), float(kv_scales[1]),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        USE_CAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32, PRECISION=precision, KV_KIND=kv_kind(k_cache),
        HAS_SINKS=sinks is not None)
    if rotated:  # the fp32 sum of rotated values, rotated back
        final.copy_(hadamard_rotate(out))
        return final
    return out
