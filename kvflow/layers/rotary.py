"""Rotary position embeddings as Hugging Face computes them: the inverse frequencies (with
Llama-3, linear or LongRoPE scaling), the cos/sin tables in fp32, and partial rotary (RoPE on
the first dims of each head only). The kernels rotate q and k in place from these tables."""
from __future__ import annotations

import math

import numpy as np
import torch

from kvflow.model.arch import LlamaArchConfig

ROPE_CACHE_MAX = 32768  # positions precomputed by default; pass max_position for longer contexts


def rope_inv_freq(arch: LlamaArchConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 or linear scaling (same formulas as transformers);
    LongRoPE's are per position (rope_tables)."""
    dim = arch.rope_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] == "longrope":
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


def rope_tables(arch: LlamaArchConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n_pos, rope_dim] in fp32. LongRoPE (Phi-3) divides the frequencies by its
    short factors up to the original context length and by its long factors beyond, and scales
    cos and sin by its attention factor, as transformers does. (transformers switches a whole
    sequence to the long factors once it outgrows the original length; here the choice is per
    position, so the keys already in the cache stay valid.)"""
    pos = torch.arange(n_pos, dtype=torch.float32)
    inv_freq = rope_inv_freq(arch)
    rs = arch.rope_scaling
    if rs is not None and rs["rope_type"] == "longrope":
        short = torch.tensor(rs["short_factor"], dtype=torch.float32)
        long = torch.tensor(rs["long_factor"], dtype=torch.float32)
        is_long = (pos >= rs["original_max_position_embeddings"]).unsqueeze(1)
        freqs = torch.where(is_long, torch.outer(pos, inv_freq / long), torch.outer(pos, inv_freq / short))
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(rs["attention_factor"])
        return emb.cos() * scale, emb.sin() * scale
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def partial_rope_(qkv: torch.Tensor, n_heads: int, head_dim: int,
                  positions: np.ndarray | torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on the first cos.shape[1] dims of each of the first n_heads heads, in place (the
    rest of each head passes through): Phi-3's partial_rotary_factor. Positions on a GPU come
    as a device tensor."""
    rot = cos.shape[1]
    x = qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)[..., :rot]
    idx = positions if isinstance(positions, torch.Tensor) else torch.from_numpy(positions)
    c, s = cos[idx].to(qkv.dtype).unsqueeze(1), sin[idx].to(qkv.dtype).unsqueeze(1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * c + rotated * s)
