"""An fp8 KV cache's per-layer scales from the checkpoint, as vLLM reads them.

A checkpoint calibrated for an fp8 KV cache carries, per attention layer, the scale its keys and
values are stored at (the cache holds x / scale in e4m3): llm-compressor and ModelOpt write
`self_attn.k_scale` and `self_attn.v_scale` (ModelOpt also `k_proj.k_scale`, `v_proj.v_scale`),
AutoFP8 and Quark `k_proj.output_scale` and `v_proj.output_scale`, and older files one
`self_attn.kv_scale` for both. Each layer's pair becomes its `kv_scales` (1.0 where the
checkpoint has none, vLLM's default); only an fp8 cache reads them.

A scale is one number per tensor, or one per kv head (compressed-tensors' `attn_head`
strategy): per-head scales are served as their largest, so no head's values saturate and e4m3's
relative step (2^-4 between its smallest normal and 448, whatever the scale) is unchanged for
all but values that the larger scale moves into its subnormals.
"""
from __future__ import annotations

import logging
import re

import torch

from kvflow.attention.kv_layout import FP8_KV_SCALE

logger = logging.getLogger("kvflow")

_LAYERS = r"^(?:model\.language_model\.|model\.)?layers\.(\d+)\.self_attn\."
_NAMES = (re.compile(_LAYERS + r"(?:attn\.)?(k|v|kv)_scale$"),
          re.compile(_LAYERS + r"(k|v)_proj\.(?:output_scale|[kv]_scale)$"))


def scale_tensor_layer(name: str) -> tuple[int, str] | None:
    """(layer index, "k" / "v" / "kv") of a KV scale tensor's name, else None."""
    for pattern in _NAMES:
        m = pattern.match(name)
        if m is not None:
            return int(m.group(1)), m.group(2)
    return None


def _scale_value(name: str, t: torch.Tensor, num_kv_heads: int) -> float:
    values = t.detach().float().flatten()
    if values.numel() not in (1, num_kv_heads):
        raise ValueError(f"KV cache scale {name!r} has {values.numel()} values: one per tensor "
                         f"or one per kv head ({num_kv_heads}) is read")
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"KV cache scale {name!r} must be finite and > 0, got {values.tolist()}")
    return float(values.max())


def read_kv_scales(tensors: dict[str, torch.Tensor], num_layers: int,
                   num_kv_heads: int) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) from the checkpoint's tensors by name (None: it has none).
    ValueError for a scale that is not a positive finite number per tensor or per kv head, or a
    layer out of range."""
    found: dict[int, dict[str, float]] = {}
    per_head = False
    for name, t in tensors.items():
        where = scale_tensor_layer(name)
        if where is None:
            continue
        layer, which = where
        if not 0 <= layer < num_layers:
            raise ValueError(f"KV cache scale {name!r}: the model has {num_layers} layers")
        per_head |= t.numel() > 1
        value = _scale_value(name, t, num_kv_heads)
        for part in ("k", "v") if which == "kv" else (which,):
            found.setdefault(layer, {})[part] = value
    if not found:
        return None
    missing = [i for i in range(num_layers) if len(found.get(i, {})) < 2]
    if missing:
        logger.warning("kvflow: the checkpoint has KV cache scales for %d of %d layers; the "
                       "others (%s) store fp8 at scale %.1f", num_layers - len(missing),
                       num_layers, ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else ""),
                       FP8_KV_SCALE)
    if per_head:
        logger.info("kvflow: per-head KV cache scales served per layer, at each layer's largest")
    return [(found.get(i, {}).get("k", FP8_KV_SCALE), found.get(i, {}).get("v", FP8_KV_SCALE))
            for i in range(num_layers)]


def checkpoint_scale_tensors(path: str) -> dict[str, torch.Tensor]:
    """The KV scale tensors of an HF folder's safetensors files, read by name (nothing else is
    read; a GGUF file or a pytorch_model.bin has none that kvflow reads)."""
    from safetensors import safe_open

    from kvflow.checkpoint.hf_folder import hf_weight_files
    from kvflow.model_path import is_gguf

    if is_gguf(path):
        return {}
    files, _ = hf_weight_files(path)
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if scale_tensor_layer(name) is not None:
                    out[name] = f.get_tensor(name)
    return out


def apply_kv_scales(model: torch.nn.Module, path: str, num_layers: int, num_kv_heads: int,
                    first_layer: int = 0) -> None:
    """Give the model's decoder layers (checkpoint layers first_layer.. on a pipeline stage)
    their checkpoint's (k_scale, v_scale)."""
    scales = read_kv_scales(checkpoint_scale_tensors(path), num_layers, num_kv_heads)
    if scales is None:
        return
    for i, layer in enumerate(model.layers):
        if hasattr(layer, "attn"):
            layer.attn.kv_scales = scales[first_layer + i]
    k, v = zip(*scales)
    logger.info("kvflow: KV cache scales from the checkpoint (an fp8 cache reads them): k_scale "
                "%.3g-%.3g, v_scale %.3g-%.3g", min(k), max(k), min(v), max(v))
