"""The PyTorch attention backend: each prompt through one SDPA call, decodes through one
batched, masked SDPA over their gathered blocks. It reads any cache dtype on any device, so it
serves where the C kernels were not built or are turned off (KVFLOW_NO_KERNELS), and is the
reference the kernels are tested against. SDPA takes no attention sinks: with them, the same
attention runs as an explicit softmax (attend_with_sinks)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_geometry, is_quantized, read_blocks, read_rows
from kvflow.attention.metadata import AttentionMetadata


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA's attention with each query head's sink logit joined to its softmax as one more key
    whose value is zero (transformers' gpt-oss eager attention: the sinks a column of the
    logits, the softmax, the column dropped), in fp32. q [B, H, Lq, D], k/v [B, KVH, S, D],
    `mask` bool [.., Lq, S] (True: seen; None: causal, the queries the last Lq positions)
    -> [B, H, Lq, D] in q's dtype."""
    heads, lq, s_len = q.shape[1], q.shape[2], k.shape[2]
    group = heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1) if group > 1 else k.float()
    v = v.float().repeat_interleave(group, dim=1) if group > 1 else v.float()
    if mask is None:
        mask = torch.ones(lq, s_len, dtype=torch.bool, device=q.device).tril(s_len - lq)
    logits = (q.float() @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    sink = sinks.to(device=q.device, dtype=torch.float32).view(1, heads, 1, 1)
    combined = torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], dim=-1)
    probs = combined.softmax(dim=-1)[..., :-1]
    return (probs @ v).to(q.dtype)


def decode_with_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor,
                      kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                      sinks: torch.Tensor | None = None) -> None:
    """Decode rows: gather each row's blocks (padded to the longest) and run one masked SDPA
    (with `sinks`, fp32 [H]: the explicit softmax that joins them)."""
    if meta._torch_decode is None:
        n_keys = meta.decode_block_tables.shape[1] * meta.block_size
        mask = np.arange(n_keys)[None, :] < meta.decode_seq_lens[:, None]
        if meta.sliding_window is not None:
            mask &= np.arange(n_keys)[None, :] >= (meta.decode_seq_lens - meta.sliding_window)[:, None]
        meta._torch_decode = (torch.from_numpy(meta.decode_rows).to(q.device),
                              torch.from_numpy(meta.decode_block_tables).to(q.device),
                              torch.from_numpy(mask[:, None, None, :]).to(q.device))
    rows, tables, mask = meta._torch_decode
    num_heads = q.shape[1]
    num_kv_heads = cache_geometry(k_cache)[1]
    kd, vd = read_blocks(k_cache, v_cache, tables, kv_scales)  # [B, L, kvh, D] -> [B, kvh, L, D]
    kd, vd = kd.transpose(1, 2).to(q.dtype), vd.transpose(1, 2).to(q.dtype)
    qd = q[rows].unsqueeze(2)  # [B, H, 1, D]
    if sinks is not None:
        od = attend_with_sinks(qd, kd, vd, mask, scale, sinks)
    else:
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale,
                                            enable_gqa=num_heads != num_kv_heads)
    out[rows] = od.squeeze(2)


def attention_with_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_kv_heads: int,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                        decode_kernel: Callable[..., bool] | None = None,
                        kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over each request's own cached K/V -> [T, H * D] in PyTorch
    (the signature of c_kernels.CAttention's call): each prompt through one SDPA call, decodes
    through one batched, masked SDPA, or through `decode_kernel` (CAttention.decode's
    signature) where given. The step's K/V must already be in the cache. `sinks`: fp32 [H], each
    query head's attention-sink logit (None: none), through attend_with_sinks."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads
    if is_quantized(k_cache.dtype):  # every key as stored, the kernels' numbers on every path
        k = v = None
    # the decode kernel's keyword only where there are sinks: any decode_kernel without them serves
    with_sinks = {} if sinks is None else {"sinks": sinks}
    if meta.num_decodes and not (decode_kernel is not None
                                 and decode_kernel(q, k_cache, v_cache, meta, scale, out,
                                                   kv_scales=kv_scales, **with_sinks)):
        decode_with_torch(q, k_cache, v_cache, meta, scale, out, kv_scales, sinks)

    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.context_slots is None and k is not None:
            kp, vp = k[rows], v[rows]
        else:
            slots = (p.context_slots if p.context_slots is not None
                     else meta.slot_mapping[rows])
            kp, vp = read_rows(k_cache, v_cache, slots, kv_scales)
        kp = kp.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kvh, S, D]
        vp = vp.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if sinks is not None:
            op = attend_with_sinks(qp, kp, vp, p.mask, scale, sinks)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask,
                                                is_causal=p.mask is None, scale=scale,
                                                enable_gqa=gqa)
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
