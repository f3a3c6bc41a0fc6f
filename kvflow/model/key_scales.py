"""Per-channel key scales for an fp8 KV cache: keys stored as k * s, queries read as q / s.

An attention score is q . k, so multiplying each key channel by s_i and the same query channel
by 1 / s_i leaves every score as it was, while e4m3 rounds different numbers. Its error is
relative to each stored value, so a key's rounding error in the score grows with the channels
where queries are large but keys small (and the other way round): after the rotation
(kv_layout.hadamard_rotate) a score's error goes as E|q / s|^2 * E|k * s|^2, least where
s_i^4 = E[q_i^2] / E[k_i^2]. The default model's score error falls 1.2x to 3x per head.

The energies are measured once, after RoPE, on a fixed run of seeded random tokens through the
model with a float cache (RoPE turns each channel pair at every position, so after it the two
channels of a pair carry the same energy and any s constant over positions is exact). Each s is
a power of two, so q / s and k * s round nothing in fp32 or bf16 (a float cache gives the same
bits with or without them) and the same weights give the same s on every process, the two sides
of a KV transfer included; per kv head the scales keep the keys' mean energy, so a checkpoint's
k_scale still fits their range.

The layers apply them after RoPE (`qk_scale`: 1 / s on each query head, s on each key head, one
multiply of the fused q and k rows; model/decode_graph.py passes it to decode_step.c), so every
kernel reads keys and queries already scaled.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import torch

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
MAX_LOG2 = 4  # scales within 2^-4 .. 2^4


def power_of_two_scales(q_energy: torch.Tensor, k_energy: torch.Tensor) -> torch.Tensor:
    """Per kv head and channel [kv_heads, D]: the mean squared query (over the heads that read
    this kv head) and key -> s, a power of two near (q / k)^(1/4), scaled per kv head so that
    the keys keep their mean energy."""
    tiny = torch.finfo(torch.float32).tiny
    q_energy, k_energy = q_energy.double().clamp_min(tiny), k_energy.double().clamp_min(tiny)
    s = (q_energy / k_energy) ** 0.25
    s = s * (k_energy.sum(-1, keepdim=True) / (s * s * k_energy).sum(-1, keepdim=True)).sqrt()
    return torch.exp2(torch.log2(s).round().clamp(-MAX_LOG2, MAX_LOG2)).float()


def qk_scale_vector(scales: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[kv_heads, D] key scales -> the multiplier of a fused row's q and k heads,
    [(num_heads + kv_heads) * D] in fp32: 1 / s on each query head (its kv head's), then s."""
    group = num_heads // scales.shape[0]
    return torch.cat([(1.0 / scales).repeat_interleave(group, 0).flatten(), scales.flatten()])


def calibrate_key_scales(model, arch) -> list[torch.Tensor]:
    """Each layer's [kv_heads, D] key scales, from one prompt of CALIBRATION_TOKENS seeded
    random tokens through `model` (on the CPU, with a cache of its own dtype)."""
    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches

    layers = model.layers
    for layer in layers:
        layer.attn.qk_scale = None
    n, bs = min(CALIBRATION_TOKENS, arch.max_position_embeddings), 16
    if hasattr(model, "cover_positions"):
        model.cover_positions(n)
    blocks = list(range(-(-n // bs)))
    caches = allocate_kv_caches(arch, len(blocks), bs, model.dtype, num_layers=len(layers))
    index = {pair[0].data_ptr(): i for i, pair in enumerate(caches)}
    q_sum, k_sum = [None] * len(layers), [None] * len(layers)
    served = model.kernels
    kernels = served.with_kv_dtype(model.dtype)  # for the cache above, whichever it serves

    def write_kv(k_cache, v_cache, k, v, *args, **kwargs):
        k_sum[index[k_cache.data_ptr()]] = k.float().square().sum(0)  # [kv_heads, D]
        return kernels.write_kv(k_cache, v_cache, k, v, *args, **kwargs)

    def attention(q, k_cache, v_cache, meta, scale, num_kv_heads, *args, **kwargs):
        sq = q.float().square().sum(0)  # [heads, D]
        q_sum[index[k_cache.data_ptr()]] = sq.view(num_kv_heads, -1, sq.shape[-1]).mean(1)
        return kernels.attention(q, k_cache, v_cache, meta, scale, num_kv_heads, *args, **kwargs)

    ids = torch.randint(0, arch.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(CALIBRATION_SEED))
    meta = build_attention_metadata(np.array([n]), np.array([n]), [blocks], bs)
    model.kernels = replace(kernels, write_kv=write_kv, attention=attention)
    try:
        with torch.no_grad():
            model(ids, torch.arange(n), caches, meta)
    finally:
        model.kernels = served
    return [power_of_two_scales(q, k) for q, k in zip(q_sum, k_sum)]


def set_key_scales(model, arch, kv_dtype: torch.dtype) -> bool:
    """Calibrate and apply the key scales where they serve: an fp8 cache on a whole model (one
    rank, every layer) on the CPU; elsewhere none. True: applied."""
    from kvflow.attention.kv_layout import FP8

    layers = getattr(model, "layers", None)
    if not layers:
        return False
    first = layers[0]
    # a model whose layers share KV (Gemma 4) reads keys that another layer's scales stored
    serves = (kv_dtype == FP8 and getattr(model, "takes_key_scales", True)
              and all(hasattr(layer, "attn") for layer in layers)
              and first.input_layernorm.device.type == "cpu"
              and getattr(first, "tp", None) is None and len(layers) == arch.num_hidden_layers)
    apply_key_scales(model, calibrate_key_scales(model, arch) if serves else None)
    return serves


def apply_key_scales(model, scales: list[torch.Tensor] | None) -> None:
    """Set each layer's `qk_scale` from its key scales (None: back to none)."""
    for i, layer in enumerate(model.layers):
        if not hasattr(layer, "attn"):  # a state layer (scales are only ever set with all attending)
            continue
        layer.attn.qk_scale = (None if scales is None else qk_scale_vector(
            scales[i], layer.attn.num_heads).to(layer.input_layernorm.device))
    forget = getattr(model, "forget_decode_graph", None)  # Llama's one-call step holds them
    if forget is not None:
        forget()


def key_scales_digest(model) -> str:
    """What a KV transfer's two sides must share besides the cache's dtype: "none", or a digest
    of the layers' multipliers (blocks stored under other key scales would be read wrongly)."""
    vectors = [layer.attn.qk_scale for layer in getattr(model, "layers", ())
               if getattr(layer, "attn", None) is not None and layer.attn.qk_scale is not None]
    if not vectors:
        return "none"
    h = hashlib.sha256()
    for v in vectors:
        h.update(v.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
