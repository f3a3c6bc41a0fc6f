"""Weights -> a ready model of its family (kvflow/models/): the whole model from an HF folder
(safetensors) or a GGUF file, or one tensor-parallel rank's shard of it. Reading the files is
kvflow.checkpoint's job; which slices a rank owns, kvflow.model.sharding's."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvflow.checkpoint.compressed_tensors import METHOD, checkpoint_method, dequantized, read_raw
from kvflow.checkpoint.conversion_cache import ensure_gguf_cache, fuse_weights, load_gguf
from kvflow.checkpoint.safetensors_io import TensorFile
from kvflow.checkpoint.hf_folder import read_hf_folder
from kvflow.model.arch import LlamaArchConfig, load_arch_config
from kvflow.model.cpu_features import cpu_features
from kvflow.model.kernels import KernelOptions, Kernels, select_kernels
from kvflow.model.kv_scales import apply_kv_scales
from kvflow.model.malloc_tuning import release_free_memory
from kvflow.model.quant.load import MXFP4, MXFP4_FAMILIES, resolve_quantization
from kvflow.model.sharding import load_shard
from kvflow.model.weight_dtype import check_checkpoint, round_weights
from kvflow.model_path import is_gguf
from kvflow.models.registry import family_of

logger = logging.getLogger("kvflow")


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


def resolve_device(name: str) -> torch.device:
    """ModelConfig.device -> torch device: "auto" is cuda when torch sees a GPU, else the CPU;
    "cuda" without a GPU is a ValueError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no GPU (this torch build "
                         f"{torch.__version__}{' has no CUDA' if torch.version.cuda is None else ''})")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def load_model(path: str, dtype: torch.dtype, device: torch.device | str | None = None,
               kernels: Kernels | None = None, quantization: str = "none",
               weight_dtype: torch.dtype | None = None, arch: LlamaArchConfig | None = None
               ) -> tuple[torch.nn.Module, LlamaArchConfig]:
    """Load the model at `path` (HF folder or .gguf) in `dtype`, weights fused for inference;
    `kernels` (default: chosen for `dtype` and `device`) serve its operations. `quantization`
    gguf, int8 or compressed-tensors (kvflow/model/quant/load.py) keeps the weights quantized,
    on the CPU; a compressed-tensors checkpoint must be loaded as one. `weight_dtype` (bf16 or
    fp16, for an fp32 model on the CPU: model/weight_dtype.storage_dtype) rounds the weights to
    it and stores the decode GEMV's panels in it. A checkpoint's KV cache scales
    (model/kv_scales.py) go to its layers. `arch`: the model's, where the caller resolved the
    model (its arch and `quantization`; the engine, once at start); else both are checked here."""
    exact = weight_dtype is not None and check_checkpoint(path, weight_dtype)
    if arch is None:  # a direct call: nothing resolved the model before
        if quantization != METHOD and checkpoint_method(path) is not None:
            resolve_quantization(quantization, path)  # raises: the checkpoint says how it is quantized
        arch = load_arch_config(path)
    family = family_of(arch.architecture)
    if quantization == MXFP4 or (quantization == "gguf" and is_gguf(path) and family.name in MXFP4_FAMILIES):
        from kvflow.model.quant.mxfp4_load import load_mxfp4_model

        # gpt-oss's MXFP4 experts as stored, the rest as floats (None: a GGUF file's experts
        # are not MXFP4, or no C kernels: floats below)
        loaded = load_mxfp4_model(path, dtype, kernels, arch)
        if loaded is not None:
            apply_kv_scales(loaded[0], path, arch.num_hidden_layers, arch.num_key_value_heads)
            return loaded
        quantization = "none"
    if quantization not in ("none", METHOD) and not family.supports.quantized:
        logger.warning("kvflow: quantization %r does not serve %s yet; its weights "
                       "are dequantised at load", quantization, family.name)
        quantization = "none"
    if quantization != "none" and family.supports.quantized:
        from kvflow.model.quant.load import load_quantized_model

        loaded = load_quantized_model(path, dtype, quantization, kernels, arch)
        if loaded is not None:
            apply_kv_scales(loaded[0], path, loaded[1].num_hidden_layers, loaded[1].num_key_value_heads)
            return loaded
    if kernels is None:
        options = replace(KernelOptions.from_env(), gemv_dtype=weight_dtype)
        kernels = select_kernels(dtype, device=device, options=options)
    on_cpu = device is None or torch.device(device).type == "cpu"
    if is_gguf(path) and weight_dtype is None and on_cpu:
        model = family.model_class(arch)(arch, dtype, device="meta", kernels=kernels)
        # one layer's float weights at a time beside the packed model, where the family packs so
        by_layer = getattr(model, "packs_by_layer", None)
        if by_layer is not None and by_layer():
            _load_packing(model, ensure_gguf_cache(path, dtype))
            apply_kv_scales(model, path, arch.num_hidden_layers, arch.num_key_value_heads)
            return model.eval(), arch
    if is_gguf(path):
        weights = load_gguf(path, dtype)
    elif quantization == METHOD:  # no int8 kernels here (or this architecture): as floats
        logger.warning("kvflow: %s int8 weights dequantised to %s at load", METHOD, dtype)
        weights = fuse_weights(dequantized(read_raw(path), dtype), arch, dtype)
    else:
        weights = fuse_weights(read_hf_folder(path, dtype), arch, dtype)
    if weight_dtype is not None and not exact:  # a checkpoint in that dtype needs no rounding
        round_weights(weights, weight_dtype)
    # build on the meta device, then adopt the loaded tensors without a second copy
    model = family.model_class(arch)(arch, dtype, device="meta", kernels=kernels)
    model.load_state_dict(weights, strict=True, assign=True)
    del weights  # the model holds them now: each goes when its packed copy is made
    model.eval()
    if device is not None:
        model.to(device)
    model.pack_weights()
    release_free_memory()  # the freed float copies back to the OS, not kept by malloc
    apply_kv_scales(model, path, arch.num_hidden_layers, arch.num_key_value_heads)
    return model, arch


def _load_packing(model: torch.nn.Module, cache_file: str) -> None:
    """Adopt a fused safetensors file's tensors, packing each decoder layer as soon as its
    weights are read: the float copy of one layer at a time sits beside the packed model
    (read all first, the whole float model did, each weight freed only as it was packed).
    The names must be the model's parameters exactly, as load_state_dict(strict=True)."""
    with TensorFile(cache_file) as f:
        expected = {name for name, _ in model.named_parameters()}
        if set(f.names) != expected:
            raise ValueError(f"weights: missing {sorted(expected - set(f.names))[:8]}, "
                             f"unexpected {sorted(set(f.names) - expected)[:8]}")
        by_layer: dict[int, list[str]] = {}
        rest = []
        for name in f.names:
            parts = name.split(".")
            if parts[0] == "layers":
                by_layer.setdefault(int(parts[1]), []).append(name)
            else:
                rest.append(name)
        model.load_state_dict({name: f.read(name) for name in rest}, strict=False, assign=True)
        for i in range(len(model.layers)):
            model.load_state_dict({name: f.read(name) for name in by_layer.get(i, [])},
                                  strict=False, assign=True)
            model.pack_layer(i)
            release_free_memory()  # the layer's float weights back to the OS (malloc keeps them otherwise)
    model.pack_head()
    release_free_memory()


def load_sharded_model(path: str, dtype: torch.dtype, tp,
                       device: torch.device | str | None = None,
                       layers: range | None = None, arch: LlamaArchConfig | None = None,
                       quantization: str = "none") -> tuple[torch.nn.Module, LlamaArchConfig]:
    """Rank `tp.rank`'s shard of the model (built on the meta device, then given its slices;
    moved to `device` when given) and the full model's arch. `tp` None: one rank, all heads;
    `layers`: a pipeline stage's decoder layers only (default: all); `arch`: the full model's,
    as the engine resolved it (else read here). `quantization` gguf: the shard of a quantized
    GGUF file as stored (kvflow/model/quant/gguf_shard.py); none: float weights."""
    rank, size = (0, 1) if tp is None else (tp.rank, tp.world_size)
    if checkpoint_method(path) is not None:  # raises: quantized checkpoints are not sharded
        resolve_quantization(None, path, tp_size=max(size, 2))
    arch = load_arch_config(path) if arch is None else arch
    family = family_of(arch.architecture)
    family.supports.check(family.name, tensor_parallel_size=size,
                          pipeline_parallel_size=1 if layers is None else 2)
    if quantization != "none" and family.supports.quantized and device is None:
        from kvflow.model.quant.load import load_quantized_model

        loaded = load_quantized_model(path, dtype, quantization, arch=arch, tp=tp, layers=layers)
        if loaded is not None:
            apply_kv_scales(loaded[0], path, arch.num_hidden_layers, arch.num_key_value_heads,
                            first_layer=0 if layers is None else layers.start)
            return loaded
    elif quantization != "none" and not family.supports.quantized:
        logger.warning("kvflow: quantization %r does not serve %s yet; its weights are "
                       "dequantised at load", quantization, family.name)
    weights = load_shard(path, arch, dtype, rank, size, layers)
    kernels = select_kernels(dtype, device=device) if device is not None else None
    model = family.model_class(arch)(arch, dtype, device="meta", tp=tp, kernels=kernels, layers=layers)
    model.load_state_dict(weights, strict=True, assign=True)
    model.eval()
    if device is not None:
        model.to(device)
    model.pack_weights()  # oneDNN copies of this rank's projections, as load_model does (CPU only)
    apply_kv_scales(model, path, arch.num_hidden_layers, arch.num_key_value_heads,
                    first_layer=0 if layers is None else layers.start)
    return model, arch


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a loaded model (or one rank's shard of it) holds as weights: a quantized one's
    panels and float tensors (its load's count), else its float parameters still in memory and
    every prepacked copy (panels, oneDNN's, the GEMV's), each tensor once."""
    report = getattr(model, "quant_report", None)
    if report is not None:
        return report["weight_bytes"]
    seen: dict[int, int] = {}
    for p in model.parameters():
        if p.device.type != "meta":
            seen[p.data_ptr()] = p.numel() * p.element_size()
    packs = [getattr(model, "packed_lm_head", None)]
    packs += [p for layer in getattr(model, "layers", []) for p in getattr(layer, "packed", {}).values()]
    for packed in packs:  # (oneDNN's copy is opaque: no data pointer, counted by identity)
        for t in (getattr(packed, f, None) for f in ("panels", "onednn", "gemv")):
            if t is not None:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
