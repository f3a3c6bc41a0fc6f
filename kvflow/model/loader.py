"""Weights -> a ready LlamaForCausalLM, from an HF folder (safetensors) or a GGUF file.

A GGUF file is dequantised once; the fused weights are then cached as safetensors (in the
requested dtype) so that later starts skip the slow conversion."""
from __future__ import annotations

import glob
import json
import os
import tempfile

import torch

from kvflow.model.arch import LlamaArchConfig, load_arch_config, save_arch_cache
from kvflow.model.cpu_features import cpu_features
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model_path import cache_dir_for, is_gguf


def resolve_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """ModelConfig.dtype -> torch dtype. "auto": bf16 on a GPU and on CPUs with native bf16
    matmul (AVX512-BF16/AMX); float32 elsewhere, where bf16 GEMMs run several times slower."""
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32"):
        return torch.float32
    if name != "auto":
        raise ValueError(f"dtype must be auto, bfloat16 or float32, got {name!r}")
    if device is not None and torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32


def load_model(path: str, dtype: torch.dtype, device: torch.device | str | None = None,
               kernels: Kernels | None = None) -> tuple[LlamaForCausalLM, LlamaArchConfig]:
    """Load the model at `path` (HF folder or .gguf) in `dtype`, weights fused for inference;
    `kernels` (default: chosen for `dtype` and `device`) serve its operations."""
    if is_gguf(path):
        arch, weights = _load_gguf(path, dtype)
    else:
        arch = load_arch_config(path)
        weights = fuse_weights(_read_hf_folder(path, arch, dtype), arch, dtype)
    # build on the meta device, then adopt the loaded tensors without a second copy
    if kernels is None:
        kernels = select_kernels(dtype, device=device)
    model = LlamaForCausalLM(arch, dtype, device="meta", kernels=kernels)
    model.load_state_dict(weights, strict=True, assign=True)
    model.eval()
    if device is not None:
        model.to(device)
    model.pack_weights()
    return model, arch


def fuse_weights(hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF parameter names -> kvflow's fused ones (qkv_proj = [q; k; v], gate_up_proj = [gate; up])."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        return hf[name].to(dtype)

    out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not arch.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight")
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[f"layers.{i}.input_layernorm"] = get(p + "input_layernorm.weight")
        out[f"layers.{i}.post_attention_layernorm"] = get(p + "post_attention_layernorm.weight")
        out[f"layers.{i}.qkv_proj"] = torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"])
        if arch.attention_bias:
            out[f"layers.{i}.qkv_bias"] = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
        out[f"layers.{i}.o_proj"] = get(a + "o_proj.weight")
        out[f"layers.{i}.gate_up_proj"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
        out[f"layers.{i}.down_proj"] = get(m + "down_proj.weight")
    return {k: v.contiguous() for k, v in out.items()}


def hf_weight_files(path: str) -> tuple[list[str], str | None]:
    """An HF folder's safetensors files (through its index when there is one), or else its
    pytorch_model.bin; ValueError when it has neither."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    if files:
        return files, None
    bin_path = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return [], bin_path
    raise ValueError(f"no safetensors weights in {path!r}")


def _read_hf_folder(path: str, arch: LlamaArchConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files, bin_path = hf_weight_files(path)
    if bin_path is not None:
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype)
    return weights


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_gguf(path: str, dtype: torch.dtype) -> tuple[LlamaArchConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    cache = cache_dir_for(path)
    cached = os.path.join(cache, f"weights.{_dtype_name(dtype)}.safetensors")
    if os.path.isfile(cached):
        return load_arch_config(path), load_file(cached)

    from kvflow.model.gguf_reader import read_gguf

    arch, arrays = read_gguf(path)
    hf = {name: torch.from_numpy(a if a.flags.writeable else a.copy()) for name, a in arrays.items()}
    weights = fuse_weights(hf, arch, dtype)
    os.makedirs(cache, exist_ok=True)
    save_arch_cache(arch, path)
    # write privately then rename: concurrent starts never read a half-written file
    fd, tmp = tempfile.mkstemp(prefix="weights.", suffix=".tmp", dir=cache)
    os.close(fd)
    save_file(weights, tmp)
    os.replace(tmp, cached)
    return arch, weights
