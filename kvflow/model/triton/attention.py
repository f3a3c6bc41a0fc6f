"""The GPU attention backend: the signature of kvflow/attention's backends (c_kernels.CAttention's
call) over the Triton kernels. A decode-only step goes through the split-K decode kernel; any step with a
prompt row through the varlen prefill kernel, which serves its decode rows too."""
from __future__ import annotations

import torch

from kvflow.model.gpu_batch import device_metadata
from kvflow.attention.kv_layout import UNIT_KV_SCALES
from kvflow.model.triton.paged_decode import paged_decode
from kvflow.model.triton.paged_prefill import paged_prefill


def attention_with_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                          scale: float, num_kv_heads: int, k: torch.Tensor | None = None,
                          v: torch.Tensor | None = None, *, sliding_window: int | None = None,
                          logits_soft_cap: float | None = None,
                          kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] over each request's cached K/V (this step's already written) -> [T, H * D].
    `meta` is an AttentionMetadata; its device arrays (`meta.gpu`) are built on first use
    unless the runner filled them (persistent buffers under a CUDA graph). `k`/`v` are
    unused: every key is read from the cache. `sliding_window` defaults to the metadata's (the
    layer's KV cache group's); `sinks`: fp32 [H], each query head's attention-sink logit."""
    num_tokens, num_heads, head_dim = q.shape
    if sliding_window is None:
        sliding_window = meta.sliding_window
    dm = meta.gpu
    if dm is None:
        dm = meta.gpu = device_metadata(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        q.device)
    if dm.decode_only:
        out = paged_decode(q, k_cache, v_cache, dm.block_tables, dm.seq_lens, scale,
                           num_splits=dm.num_splits, sliding_window=sliding_window,
                           logits_soft_cap=logits_soft_cap, workspace=dm.workspace,
                           kv_scales=kv_scales, sinks=sinks)
    else:
        out = paged_prefill(q, k_cache, v_cache, dm.block_tables, dm.seq_lens, dm.query_start_loc,
                            dm.max_query_len, scale, sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap, kv_scales=kv_scales, sinks=sinks)
    return out.reshape(num_tokens, num_heads * head_dim)
