"""Rotary position embeddings as Hugging Face computes them: the inverse frequencies (with
Llama-3, linear, YaRN or LongRoPE scaling), the cos/sin tables in fp32, and partial rotary (RoPE on
the first dims of each head only). The kernels rotate q and k in place from these tables."""
from __future__ import annotations

import math

import numpy as np
import torch

from kvflow.model.arch import LlamaArchConfig

ROPE_CACHE_MAX = 32768  # positions precomputed by default; pass max_position for longer contexts


def rope_inv_freq(arch: LlamaArchConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3, linear or YaRN scaling (same formulas as
    transformers); LongRoPE's are per position (rope_tables)."""
    dim = arch.rope_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] == "longrope":
        return inv_freq
    if rs["rope_type"] == "yarn":
        return yarn_inv_freq(arch)
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


def yarn_factor(arch: LlamaArchConfig) -> float:
    """YaRN's context extension factor: the config's, else the ratio of the context lengths."""
    rs = arch.rope_scaling
    return float(rs.get("factor") or arch.max_position_embeddings / rs["original_max_position_embeddings"])


def yarn_attention_factor(arch: LlamaArchConfig) -> float:
    """What YaRN multiplies cos and sin by: the config's attention_factor, else the paper's
    mscale 0.1 ln(factor) + 1 (DeepSeek's ratio of two mscales where both are given)."""
    rs = arch.rope_scaling
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = yarn_factor(arch)
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return float(mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"]))
    return mscale(factor)


def yarn_inv_freq(arch: LlamaArchConfig) -> torch.Tensor:
    """YaRN (NTK-by-parts): each frequency a blend of the original (extrapolated) and the one
    divided by `factor` (interpolated), by a linear ramp over the dims whose wavelengths fit
    between beta_fast and beta_slow rotations in the original context (its ends rounded
    outward unless `truncate` is false), as transformers' _compute_yarn_parameters."""
    rs, dim, base = arch.rope_scaling, arch.rope_dim, arch.rope_theta
    factor, original = yarn_factor(arch), rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(arch: LlamaArchConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n_pos, rope_dim] in fp32. LongRoPE (Phi-3) divides the frequencies by its
    short factors up to the original context length and by its long factors beyond, and scales
    cos and sin by its attention factor, as transformers does. (transformers switches a whole
    sequence to the long factors once it outgrows the original length; here the choice is per
    position, so the keys already in the cache stay valid.) YaRN scales cos and sin by its
attention factor too."""
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
    if rs is not None and rs["rope_type"] == "yarn":
        scale = yarn_attention_factor(arch)
        return emb.cos() * scale, emb.sin() * scale
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
