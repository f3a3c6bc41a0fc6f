"""Checkpoint files -> tensors under kvflow's fused names, shared by the whole-model loader and
the tensor-parallel shard loader: an HF folder's weight files, the fusing of HF names
(qkv_proj = [q; k; v], gate_up_proj = [gate; up]), and a GGUF file's conversion cache.

A GGUF file is dequantised once; the fused weights are then cached as safetensors (in the
requested dtype) so that later starts skip the slow conversion. The cache file is written under
a lock (concurrent starts convert once), fsynced and renamed into place, and checked on every
load: a torn or truncated file (its size disagrees with its header, or its tensor count with
the count stamped in it) is converted again."""
from __future__ import annotations

import glob
import json
import logging
import os
import tempfile

import torch

from kvflow.model.arch import LlamaArchConfig, load_arch_config, save_arch_cache
from kvflow.model.gemma3_weights import gemma3_norms, text_part
from kvflow.model.gguf_reader import read_gguf
from kvflow.model_path import cache_dir_for
from kvflow.utils.files import file_lock, publish

logger = logging.getLogger("kvflow")
_COUNT_KEY = "kvflow_num_tensors"  # stamped in the cache file's metadata


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fuse_weights(hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF parameter names -> kvflow's fused ones (qkv_proj = [q; k; v], gate_up_proj = [gate; up];
    an expert layer's weights stacked per expert, kvflow/model/moe.py)."""
    gemma3 = arch.architecture == "Gemma3ForCausalLM"
    if gemma3:
        hf = text_part(hf)
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        return hf[name].to(dtype)

    fused_in_checkpoint = arch.architecture == "Phi3ForCausalLM"  # Phi-3 ships qkv and gate_up fused
    out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not arch.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight")
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[f"layers.{i}.input_layernorm"] = get(p + "input_layernorm.weight")
        out[f"layers.{i}.post_attention_layernorm"] = get(p + "post_attention_layernorm.weight")
        if fused_in_checkpoint:
            out[f"layers.{i}.qkv_proj"] = get(a + "qkv_proj.weight")
        else:
            out[f"layers.{i}.qkv_proj"] = torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"])
        if arch.attention_bias:
            out[f"layers.{i}.qkv_bias"] = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
        if arch.qk_norm:
            out[f"layers.{i}.q_norm"] = get(a + "q_norm.weight")
            out[f"layers.{i}.k_norm"] = get(a + "k_norm.weight")
        out[f"layers.{i}.o_proj"] = get(a + "o_proj.weight")
        if arch.is_moe_layer(i):
            out.update(fuse_experts(get, arch, i))
        elif fused_in_checkpoint:
            out[f"layers.{i}.gate_up_proj"] = get(m + "gate_up_proj.weight")
            out[f"layers.{i}.down_proj"] = get(m + "down_proj.weight")
        else:
            out[f"layers.{i}.gate_up_proj"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            out[f"layers.{i}.down_proj"] = get(m + "down_proj.weight")
    if gemma3:  # its norms (four per layer, QK-norm) as fp32 multipliers 1 + weight
        out.update(gemma3_norms(hf, arch))
    return {k: v.contiguous() for k, v in out.items()}


def fuse_experts(get, arch: LlamaArchConfig, i: int) -> dict[str, torch.Tensor]:
    """Layer i's expert block: the router, every expert's [gate; up] and down stacked into
    [experts, ...] tensors, and Qwen2-MoE's shared expert with its gate."""
    if arch.architecture == "MixtralForCausalLM":
        p = f"model.layers.{i}.block_sparse_moe."
        router, gate, up, down = p + "gate.weight", p + "experts.{}.w1.weight", \
            p + "experts.{}.w3.weight", p + "experts.{}.w2.weight"
    else:
        p = f"model.layers.{i}.mlp."
        router, gate, up, down = p + "gate.weight", p + "experts.{}.gate_proj.weight", \
            p + "experts.{}.up_proj.weight", p + "experts.{}.down_proj.weight"
    experts = range(arch.num_experts)
    q = f"layers.{i}.moe."
    out = {q + "router": get(router),
           q + "gate_up": torch.stack([torch.cat([get(gate.format(e)), get(up.format(e))]) for e in experts]),
           q + "down": torch.stack([get(down.format(e)) for e in experts])}
    if arch.shared_expert_intermediate_size:
        s = p + "shared_expert."
        out[q + "shared_gate_up"] = torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")])
        out[q + "shared_down"] = get(s + "down_proj.weight")
        out[q + "shared_gate"] = get(p + "shared_expert_gate.weight")
    return out


# -- HF folders ------------------------------------------------------------------------------
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


def read_hf_folder(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder under its HF name."""
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


# -- GGUF files --------------------------------------------------------------------------------
def gguf_cache_file(path: str, dtype: torch.dtype) -> str:
    """Where the fused safetensors conversion of the GGUF file `path` in `dtype` is cached."""
    return os.path.join(cache_dir_for(path), f"weights.{dtype_name(dtype)}.safetensors")


def cache_file_is_complete(path: str) -> bool:
    """A safetensors cache file whose size matches its header and whose tensor count matches
    the count stamped in it when it was written (False for a missing or torn file)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        # (files from before the stamp have none: their size check suffices)
        return size == 8 + n + end and meta.get(_COUNT_KEY, str(len(header))) == str(len(header))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def load_gguf(path: str, dtype: torch.dtype) -> tuple[LlamaArchConfig, dict[str, torch.Tensor]]:
    """The arch and fused weights of a GGUF file, from the conversion cache (made on a miss)."""
    from safetensors.torch import load_file

    cached = gguf_cache_file(path, dtype)
    if not cache_file_is_complete(cached):
        with _conversion_lock(cached):
            if not cache_file_is_complete(cached):  # another start may have made it meanwhile
                return _convert_gguf(path, dtype, cached)
    return load_arch_config(path), load_file(cached)


def ensure_gguf_cache(path: str, dtype: torch.dtype) -> str:
    """The fused safetensors conversion of a GGUF file, made once per machine (the only step
    that dequantises the whole model); ranks starting together wait for one conversion."""
    cached = gguf_cache_file(path, dtype)
    if not cache_file_is_complete(cached):
        with _conversion_lock(cached):
            if not cache_file_is_complete(cached):
                _convert_gguf(path, dtype, cached)  # the returned full weights are dropped
    return cached


def _conversion_lock(cached: str):
    return file_lock(os.path.join(os.path.dirname(cached), "convert.lock"))


def _convert_gguf(path: str, dtype: torch.dtype, cached: str
                  ) -> tuple[LlamaArchConfig, dict[str, torch.Tensor]]:
    """Dequantise and fuse, then publish the cache file (call with the conversion lock held)."""
    from safetensors.torch import save_file

    if os.path.exists(cached):
        logger.warning("kvflow: the weight cache %s is incomplete; converting again", cached)
    arch, arrays = read_gguf(path)
    hf = {name: torch.from_numpy(a if a.flags.writeable else a.copy()) for name, a in arrays.items()}
    weights = fuse_weights(hf, arch, dtype)
    cache = os.path.dirname(cached)
    os.makedirs(cache, exist_ok=True)
    save_arch_cache(arch, path)
    fd, tmp = tempfile.mkstemp(prefix="weights.", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        save_file(weights, tmp, metadata={_COUNT_KEY: str(len(weights))})
        publish(tmp, cached)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return arch, weights
