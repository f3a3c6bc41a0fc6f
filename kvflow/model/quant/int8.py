"""int8 W8A8 for any float model: each output channel's weights scaled to -127..127 once at
load (one scale per channel), the activations per token at each call (one scale per row);
both then meet in gemm_quant.c's q8 GEMM, whose per-block scales all carry the channel's.
compressed-tensors checkpoints (read by kvflow/checkpoint/compressed_tensors.py) bring their
own int8 values and scales (load_int8)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from kvflow.checkpoint.compressed_tensors import (_refuse, check_scheme, int8_weight,
                                                  is_quantized, quantization_config, read_raw)
from kvflow.model.quant.packing import BLOCK, pack
from kvflow.model.quant.qlinear import QuantizedWeight

logger = logging.getLogger("kvflow")


def quantize_int8(w: torch.Tensor, isa: str) -> QuantizedWeight:
    """A float (N, K) weight -> per-channel int8 (K padded to whole blocks with zeros)."""
    n, k = w.shape
    kb = -(-k // BLOCK)
    a = np.zeros((n, kb * BLOCK), dtype=np.float32)
    a[:, :k] = w.detach().float().numpy()
    # the channel's scale as stored (fp16), so that q is rounded against the scale in use
    d = (np.abs(a).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(a * inv[:, None]), -127, 127).astype(np.int8)
    return int8_from_channels(q, d, isa, k=k)


def int8_from_channels(q: np.ndarray, scale: np.ndarray, isa: str, source: str = "int8",
                       k: int | None = None) -> QuantizedWeight:
    """int8 values q (N, K') (-128..127) and one scale per output channel (N,), weight =
    scale * q, as W8A8 panels (q's columns past `k`, and K up to whole blocks, are zeros)."""
    n = q.shape[0]
    k = q.shape[1] if k is None else k
    kb = -(-k // BLOCK)
    if q.shape[1] != kb * BLOCK:
        padded = np.zeros((n, kb * BLOCK), dtype=np.int8)
        padded[:, : q.shape[1]] = q
        q = padded
    packed = pack("q8", q, np.repeat(np.asarray(scale, dtype=np.float32)[:, None], kb, axis=1))
    return QuantizedWeight(kind="q8", n=n, k=k, packed=packed, isa=isa, source=source, per_row=True)


# -- compressed-tensors checkpoints ----------------------------------------------------------
# kvflow's fused projection -> the HF Linear modules it is made of (checkpoints that ship them
# fused, like Phi-3, name the fused module itself)
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",),
         "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}
_CHECKPOINT_FUSED = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}


def _modules(raw: dict, layer: int, fused: str) -> list[str]:
    p = f"model.layers.{layer}."
    own = _CHECKPOINT_FUSED.get(fused)
    if own is not None and p + own + ".weight" in raw:
        return [p + own]
    return [p + m for m in FUSED[fused]]


def load_int8(path: str, dtype: torch.dtype, isa: str, arch=None):
    """(arch, float tensors under kvflow's names, QuantizedWeights under kvflow's names) of a
    compressed-tensors W8A8 folder. A fused projection's parts must all be int8 or all float;
    float ones (ignored modules: the LM head, usually) stay in the float dict. `arch`: the
    model's, where the caller resolved it (else read here)."""
    from kvflow.checkpoint.conversion_cache import fuse_weights
    from kvflow.model.arch import load_arch_config

    qc = quantization_config(path)
    check_scheme(qc)
    arch = load_arch_config(path) if arch is None else arch
    raw = read_raw(path)
    quant, rounded = {}, 0
    for i in range(arch.num_hidden_layers):
        for fused in FUSED:
            modules = _modules(raw, i, fused)
            flags = {is_quantized(m, qc) for m in modules}
            if len(flags) > 1:
                raise _refuse(f"layer {i} {fused}: some of {modules} quantized, some not")
            if flags == {True}:
                quant[f"layers.{i}.{fused}"], r = _fused(raw, modules, isa)
                rounded += r
                for m in modules:  # what fuse_weights looks for: a shape, no memory
                    raw[m + ".weight"] = torch.empty(0, device="meta")
    if not arch.tie_word_embeddings and is_quantized("lm_head", qc):
        quant["lm_head"], r = _fused(raw, ["lm_head"], isa)
        rounded += r
        raw["lm_head.weight"] = torch.empty(0, device="meta")
    elif arch.tie_word_embeddings and "lm_head.weight_scale" in raw:
        raise _refuse("an int8 lm_head tied to the float embedding")
    left = sorted(n for n in raw if n.endswith(".weight_scale"))
    if left:
        raise ValueError(f"compressed-tensors checkpoint: int8 weights kvflow does not know: {left[:3]}")
    if rounded:
        logger.info("kvflow: %d weight scales of %s rounded to fp16 (relative error < 2^-11)",
                    rounded, path)
    weights = fuse_weights(raw, arch, dtype)
    plain = {k: v for k, v in weights.items() if v.device.type != "meta"}
    return arch, plain, quant


def _fused(raw: dict, modules: list[str], isa: str):
    parts = [int8_weight(raw, m) for m in modules]
    q = np.concatenate([p[0] for p in parts])
    scale = np.concatenate([p[1] for p in parts])
    if scale.max(initial=0.0) > 65504.0:  # the panels hold fp16 scales
        raise ValueError(f"compressed-tensors checkpoint: {modules[0]}.weight_scale exceeds "
                         "fp16's range (65504)")
    rounded = int(np.count_nonzero(scale.astype(np.float16).astype(np.float32) != scale))
    return int8_from_channels(q, scale, isa, source="compressed-tensors"), rounded
