"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2): one flat batch of tokens, paged KV.

Weights are fused at load time (q|k|v rows into `qkv_proj`, gate|up into `gate_up_proj`) so
each layer runs four matmuls. Numerics follow Hugging Face's LlamaModel (RMSNorm in fp32,
rotate_half RoPE with cos/sin computed in fp32)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention import AttentionMetadata, paged_attention, write_kv

ROPE_CACHE_MAX = 32768  # positions precomputed by default; pass max_position for longer contexts


def rope_inv_freq(arch: LlamaArchConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 or linear scaling (same formulas as transformers)."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, smooth blend in between
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.scale = d ** -0.5
        self.input_layernorm = _weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = _weight(h, dtype=dtype, device=device)
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        self.qkv_bias = (_weight(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if arch.attention_bias else None)
        self.o_proj = _weight(h, self.q_size, dtype=dtype, device=device)
        self.gate_up_proj = _weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = _weight(h, arch.intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        h = rms_norm(x, self.input_layernorm, self.eps)
        qkv = F.linear(h, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.num_kv_heads, k=k, v=v)
        x = x + F.linear(attn, self.o_proj)
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        gate, up = F.linear(h, self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a flat, unpadded batch of tokens from many requests."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None):
        super().__init__()
        self.arch, self.dtype = arch, dtype
        h = arch.hidden_size
        self.embed_tokens = _weight(arch.vocab_size, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, dtype, device) for _ in range(arch.num_hidden_layers))
        self.norm = _weight(h, dtype=dtype, device=device)
        # tied models read the embedding matrix directly (no second parameter to keep in sync)
        self.lm_head = (None if arch.tie_word_embeddings
                        else _weight(arch.vocab_size, h, dtype=dtype, device=device))
        # cos/sin in fp32 like HF; on the CPU even when the weights start on the meta device
        rope_device = None if device is None or torch.device(device).type == "meta" else device
        n_pos = max_position or min(arch.max_position_embeddings, ROPE_CACHE_MAX)
        freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), rope_inv_freq(arch))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(rope_device), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(rope_device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for the flat batch; K/V land in `kv_caches`."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attn_metadata)
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] in fp32 for the rows that sample."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
