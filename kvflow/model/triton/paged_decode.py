"""Decode attention: one query token per sequence over its paged K/V, split over the KV length.

Grid (sequence, kv head, split): each program takes the GQA group of query heads that share one
KV head (each K/V tile is read once for the whole group) over its share of the sequence's keys,
and writes a partial output normalised by its own softmax sum, with that sum's log-sum-exp. A
second kernel merges the splits by their LSEs. Every sequence is cut into the same number of
splits (`num_splits`, fixed for a CUDA graph's life), each `ceil(len / num_splits)` keys long,
so long contexts occupy the GPU (gpu_batch.num_decode_splits chooses) and short ones cost one near-empty program per split.
Attention sinks (one logit per query head, a key whose value is zero) join in the merge: the
sink is one more term of the splits' common denominator.

A sequence of length 0 (padding in a captured graph) writes zeros."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_geometry, hadamard_rotate, rotates
from kvflow.model.triton.layout import (key_offset, kv_kind, kv_operands, load_kv, soft_cap,
                                        tile_base, value_offset)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, part_out, part_lse,
                         scale, cap, window, k_fp8_scale, v_fp8_scale, stride_q_tok, stride_q_head, stride_bt,
                         NUM_SPLITS: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, USE_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                         KV_KIND: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    if USE_WINDOW:  # the query at seq_len - 1 sees keys j with seq_len - 1 - j < window
        lo = tl.maximum(lo, seq_len - window)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
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
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [G, N]
        if USE_CAP:
            s = soft_cap(s, cap)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new

    has = l > 0.0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    row = (seq * HEADS + heads).to(tl.int64) * NUM_SPLITS + split
    tl.store(part_out + row[:, None] * HEAD_DIM + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_lse + row, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out_ptr, sinks_ptr, stride_o_tok, stride_o_head,
                         NUM_SPLITS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * HEADS + head).to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse + row + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:  # the sink's logit is one more log-sum-exp, of a zero value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    parts = tl.load(part_out + (row + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=(s[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 num_splits: int = 1, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, out: torch.Tensor | None = None,
                 workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, H, D] (row b the last token of sequence b, at position seq_lens[b] - 1)
    over each sequence's cached keys 0..seq_lens[b] - 1 through block_tables [B, max_blocks]
    (int32/int64). Returns out [B, H, D] in q's dtype. `workspace`: preallocated (partial
    outputs [B * H * num_splits, D] fp32, LSEs [B * H * num_splits] fp32), for CUDA graphs;
    `kv_scales`: an fp8 cache's (k_scale, v_scale); `sinks`: fp32 [H], each query head's
    attention-sink logit (None: none)."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads, cache_dim = cache_geometry(k_cache)
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q has {heads} heads of {head_dim}; the cache {kv_heads} of {cache_dim}")
    if q.stride(2) != 1:
        raise ValueError("q's head dim must be dense")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = heads // kv_heads
    if workspace is None:
        workspace = (torch.empty(batch * heads * num_splits, head_dim, dtype=torch.float32, device=q.device),
                     torch.empty(batch * heads * num_splits, dtype=torch.float32, device=q.device))
    part_out, part_lse = workspace
    rotated = rotates(k_cache)  # rotated keys and values: q rotated alike, out back
    if rotated:
        q, final = hadamard_rotate(q).to(q.dtype), out
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    (kc, ks), (vc, vs) = kv_operands(k_cache), kv_operands(v_cache)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, kc, vc, ks, vs, block_tables, seq_lens, part_out, part_lse,
        scale, float(logits_soft_cap or 0.0), int(sliding_window or 0),
        float(kv_scales[0]), float(kv_scales[1]),
        q.stride(0), q.stride(1), block_tables.stride(0),
        NUM_SPLITS=num_splits, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 2),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=max(triton.next_power_of_2(block_size), 16),
        USE_CAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        KV_KIND=kv_kind(k_cache))
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    _merge_splits_kernel[(batch, heads)](
        part_out, part_lse, out, part_lse if sinks is None else sinks, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_S=max(triton.next_power_of_2(num_splits), 2), BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SINKS=sinks is not None)
    if rotated:  # the fp32 sum of rotated values, rotated back
        final.copy_(hadamard_rotate(out))
        return final
    return out
