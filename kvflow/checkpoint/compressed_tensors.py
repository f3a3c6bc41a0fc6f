"""compressed-tensors int8 W8A8 checkpoints (what llm-compressor's W8A8 recipes write and vLLM
serves): an HF folder whose config.json carries `quantization_config` with
`quant_method: compressed-tensors`, each quantized Linear stored as `<module>.weight` (int8) and
`<module>.weight_scale` (one float per output channel, or one per tensor), weight = scale * q.

Detected from config.json, as vLLM does, and read here: the scheme checked, the int8 values
and scales. Served (kvflow/model/quant/int8.py's load_int8) by the same q8 panels and kernels
as `--quantization int8`, from the checkpoint's own int8 values (nothing is requantized; the
scales are held in fp16 as the panels store them: exact for bf16/fp16 scales in fp16's normal
range, within 2^-11 relative for fp32 ones). The one scheme served is vLLM's W8A8Int8 with
dynamic activations: weights int8, symmetric, per channel (or per tensor), activations int8,
symmetric, dynamic, per token; with it, or alone (float weights), an fp8 KV cache's static
scales (`kv_cache_scheme`, read by kvflow/model/kv_scales.py). Anything else is refused by name
(SUPPORTED says what runs)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from kvflow.model_path import is_gguf

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
SUPPORTED = ("kvflow serves compressed-tensors int8 W8A8 only: format int-quantized or "
             "naive-quantized; weights num_bits 8, type int, symmetric, strategy channel or "
             "tensor; input_activations num_bits 8, type int, symmetric, dynamic, strategy token; "
             "kv_cache_scheme num_bits 8, type float, static, strategy tensor or attn_head")


def quantization_config(path: str) -> dict | None:
    """config.json's `quantization_config` of an HF folder (None: a GGUF file, or none)."""
    if is_gguf(path):
        return None
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        qc = json.load(f).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    return qc


def checkpoint_method(path: str) -> str | None:
    """The checkpoint's own quantization (quant_method, lower case), or None for floats."""
    qc = quantization_config(path)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower() or "unknown"
    if method == METHOD and qc.get("kv_cache_scheme") and not qc.get("config_groups"):
        check_kv_cache_scheme(qc["kv_cache_scheme"])  # float weights; only the KV cache's scales
        return None
    return method


def _refuse(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported. {SUPPORTED}")


def check_scheme(qc: dict) -> None:
    """ValueError naming the first thing in `qc` that kvflow does not run."""
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise _refuse(f"format {fmt!r}")
    if qc.get("sparsity_config"):
        raise _refuse("sparsity_config (sparse weights)")
    if qc.get("transform_config"):
        raise _refuse("transform_config (rotated weights)")
    if qc.get("kv_cache_scheme"):
        check_kv_cache_scheme(qc["kv_cache_scheme"])
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (weights not stored as int8)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("a quantization_config without config_groups")
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise _refuse(f"config group {name!r} that is not an object")
        if g.get("format") not in (None, *FORMATS):
            raise _refuse(f"group {name}: format {g.get('format')!r}")
        if g.get("output_activations"):
            raise _refuse(f"group {name}: output_activations")
        w, a = g.get("weights"), g.get("input_activations")
        if not isinstance(w, dict):
            raise _refuse(f"group {name}: no weights scheme")
        if not isinstance(a, dict):
            raise _refuse(f"group {name}: weight-only quantization (no input_activations)")
        _check_args(f"group {name}: weights", w, strategies=("channel", "tensor"), dynamic=False)
        _check_args(f"group {name}: input_activations", a, strategies=("token",), dynamic=True)


def check_kv_cache_scheme(scheme) -> None:
    """An fp8 KV cache's static scales (per tensor or per kv head, model/kv_scales.py reads
    them) are served with `kv_cache_dtype fp8`; any other kv_cache_scheme is refused by name."""
    where = "kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise _refuse(f"{where} that is not an object")
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float":
        raise _refuse(f"{where} num_bits {scheme.get('num_bits')!r} type {scheme.get('type')!r} "
                      "(an fp8 KV cache, num_bits 8 type float, is served)")
    if scheme.get("symmetric") is False:
        raise _refuse(f"{where} symmetric false (asymmetric zero points)")
    if scheme.get("dynamic"):
        raise _refuse(f"{where} dynamic {scheme.get('dynamic')!r} (static scales are read)")
    if scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise _refuse(f"{where} strategy {scheme.get('strategy')!r}")


def _check_args(where: str, args: dict, strategies: tuple[str, ...], dynamic: bool) -> None:
    if args.get("num_bits") != 8:
        raise _refuse(f"{where} num_bits {args.get('num_bits')!r}")
    if args.get("type") != "int":
        raise _refuse(f"{where} type {args.get('type')!r}")
    if args.get("symmetric") is not True:
        raise _refuse(f"{where} symmetric {args.get('symmetric')!r} (asymmetric zero points)")
    if bool(args.get("dynamic", False)) != dynamic:
        raise _refuse(f"{where} dynamic {args.get('dynamic')!r} "
                      f"({'static activation scales' if not dynamic else 'dynamic weights'})")
    if args.get("strategy") not in strategies:
        raise _refuse(f"{where} strategy {args.get('strategy')!r}")
    if args.get("group_size") is not None or args.get("block_structure") is not None:
        raise _refuse(f"{where} group_size/block_structure")
    if args.get("actorder") is not None:
        raise _refuse(f"{where} actorder {args.get('actorder')!r}")


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:<pattern>` is re.match on the module's name, `Linear` (a
    class name) every Linear module, anything else the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def is_quantized(module: str, qc: dict) -> bool:
    """The HF Linear module `module` (e.g. model.layers.0.mlp.up_proj, lm_head) is int8 in
    this checkpoint: some group targets it and `ignore` does not name it."""
    if any(_matches(module, t) for t in qc.get("ignore") or ()):
        return False
    return any(_matches(module, t) for g in qc["config_groups"].values()
               for t in g.get("targets") or ())


def read_raw(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder under its HF name, in its stored dtype."""
    from safetensors import safe_open

    from kvflow.checkpoint.hf_folder import hf_weight_files

    files, bin_path = hf_weight_files(path)
    if bin_path is not None:
        raise ValueError("compressed-tensors checkpoint: weights must be in safetensors files")
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def int8_weight(raw: dict[str, torch.Tensor], module: str) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 (N, K), per-channel scale float32 (N,)) of a quantized module, popped from
    `raw`; ValueError for anything but int8 weights with one scale per channel or tensor."""
    w, s = raw.pop(module + ".weight", None), raw.pop(module + ".weight_scale", None)
    if w is None or s is None:
        raise ValueError(f"compressed-tensors checkpoint: {module}.weight and .weight_scale "
                         "must both be present")
    zp = raw.pop(module + ".weight_zero_point", None)
    if zp is not None and bool(zp.ne(0).any()):
        raise _refuse(f"{module}: non-zero weight_zero_point")
    for extra in ("input_scale", "input_zero_point", "weight_g_idx", "weight_shape", "weight_packed"):
        if module + "." + extra in raw:
            raise _refuse(f"{module}.{extra}")
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"compressed-tensors checkpoint: {module}.weight is {w.dtype} "
                         f"{tuple(w.shape)}, expected a 2-D int8 tensor")
    n = w.shape[0]
    if s.numel() == 1:
        s = s.reshape(1).expand(n)
    elif s.numel() == n:
        s = s.reshape(n)
    else:
        raise ValueError(f"compressed-tensors checkpoint: {module}.weight_scale has shape "
                         f"{tuple(s.shape)}, expected ({n}, 1) or (1,)")
    scale = s.float().numpy().astype(np.float32)
    if not np.all(np.isfinite(scale)) or np.any(scale < 0):
        raise ValueError(f"compressed-tensors checkpoint: {module}.weight_scale must be finite "
                         "and non-negative")
    return w.numpy(), scale


def dequantized(raw: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint as floats under HF names: every int8 module's weight = scale * q (the
    reference the int8 path is tested against, and the load where C kernels are missing)."""
    raw = dict(raw)
    out = {}
    for module in [n.removesuffix(".weight_scale") for n in raw if n.endswith(".weight_scale")]:
        q, scale = int8_weight(raw, module)
        out[module + ".weight"] = torch.from_numpy(q.astype(np.float32) * scale[:, None]).to(dtype)
    out.update({name: t.to(dtype) for name, t in raw.items()})
    return out
