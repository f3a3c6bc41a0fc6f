"""One decoder layer's attention over the paged KV cache, shared by every family: it takes the
fused q|k|v rows after RoPE, writes this step's K/V into the layer's cache, attends through the
backend chosen at load (the model's `kernels`), and returns the heads' outputs [T, heads * D]
for the output projection. It holds what an fp8 cache needs per layer (the checkpoint's
(k_scale, v_scale) and the calibrated key scales), a family's attention sinks where it has them
(gpt-oss: one learned logit per query head that joins every softmax's denominator as a key
whose value is zero), and declares its KV cache spec: a full-context layer or a sliding window,
which the scheduler's KV cache groups are made of."""
from __future__ import annotations

import torch
from torch import nn

from kvflow.attention.bidirectional import attend_runs
from kvflow.attention.kv_layout import UNIT_KV_SCALES
from kvflow.attention.metadata import AttentionMetadata
from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvflow.model.kernels import Kernels


class Attention(nn.Module):
    """`scale` multiplies q.k (head_dim ** -0.5 unless the family says otherwise);
    `sliding_window`: the last positions this layer sees (None: the whole context)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # an fp8 KV cache's (k_scale, v_scale): the checkpoint's (model/kv_scales.py) or 1.0
        self.kv_scales = UNIT_KV_SCALES
        # an fp8 KV cache's key scales as the multiplier of q and k after RoPE
        # [(heads + kv_heads) * D] (model/key_scales.py); None: no multiplier
        self.qk_scale: torch.Tensor | None = None
        # attention sinks: fp32 [num_heads], one logit per query head, set by the family that
        # has them (None: a plain softmax); every attention backend takes them
        self.sinks: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """Its window and its own shape: layers of another window or shape are another group."""
        shape = {"num_kv_heads": self.num_kv_heads, "head_size": self.head_dim}
        if self.sliding_window:
            return SlidingWindowSpec(self.sliding_window, **shape)
        return FullAttentionSpec(**shape)

    def forward(self, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kernels: Kernels) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) * D], q and k rotated (the key scales are applied here,
        in place); K/V land in `kv_cache` at `meta.slot_mapping`."""
        t, d = qkv.shape[0], self.head_dim
        if self.qk_scale is not None:
            qkv[:, :self.q_size + self.kv_size].mul_(self.qk_scale)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attend(q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                           v.view(t, self.num_kv_heads, d), kv_cache, meta, kernels)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               kernels: Kernels, write: bool = True) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv_heads, D] (rotated, scaled) -> [T, heads * D].
        write False: a layer that shares another layer's KV (Gemma 4's last layers) attends
        over that layer's cache, already written this step, with its k and v."""
        k_cache, v_cache = kv_cache
        if write:
            kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.kv_scales)
        # the cache's kv heads: a layer's own, or more where its cache is a wider layer's
        out = kernels.attention(q, k_cache, v_cache, meta, self.scale, k_cache.shape[1], k=k, v=v,
                                kv_scales=self.kv_scales, sinks=self.sinks)
        if meta.bidirectional_runs:  # an image's tokens see each other (attention/bidirectional.py)
            out = attend_runs(out, q, k_cache, v_cache, meta, self.scale, self.kv_scales)
        return out
