"""A model of its family (kvflow/models/) whose projections, LM head and embedding are
quantized weights: from a quantized GGUF file as it is stored (`gguf`), or from any float model
quantized to int8 W8A8 at load (`int8`). The model's float parameters for those weights stay on
the meta device (no memory): the projections are read through `layer.packed[...].quant`, the
embedding through `model.quantized_embedding`. The load reports the weights' bytes and the
process's RSS."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from kvflow.checkpoint.compressed_tensors import (METHOD, SUPPORTED, check_scheme,
                                                  checkpoint_method, quantization_config)
from kvflow.csrc import library
from kvflow.model.arch import LlamaArchConfig, load_arch_config
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.packed_linear import PackedWeight
from kvflow.model.quant.packing import dequantize_rows
from kvflow.model.quant.qlinear import QuantizedWeight, best_isa
from kvflow.model_path import is_gguf
from kvflow.models.registry import family_of

logger = logging.getLogger("kvflow")
QUANTIZATIONS = ("gguf", "int8", "compressed-tensors", "mxfp4", "none")
MXFP4 = "mxfp4"  # a checkpoint's own (gpt-oss's experts): kvflow/model/quant/mxfp4_load.py
MXFP4_FAMILIES = ("gpt-oss",)  # whose experts checkpoints (and llama.cpp's files) store in MXFP4
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def resolve_quantization(requested: str | None, path: str, tp_size: int = 1,
                         on_gpu: bool = False) -> str:
    """The option's value -> what serves: default `gguf` for a GGUF file (a float GGUF then
    loads as floats), `compressed-tensors` for an HF folder whose config.json says so (as
    vLLM reads it; an explicit other choice is refused), else `none`. Quantized weights are
    the CPU kernels'. `tp_size`: the ranks the model is split over (tensor x pipeline): a
    GGUF file is sharded as stored (gguf_shard.py); int8 W8A8 is not sharded, so an explicit
    int8 is refused there, and so is a compressed-tensors checkpoint (it cannot fall back)."""
    method = checkpoint_method(path)
    if method == MXFP4:
        return _mxfp4_quantization(requested, tp_size, on_gpu)
    if method is not None:
        return _checkpoint_quantization(method, requested, path, tp_size, on_gpu)
    if requested is None:
        return "gguf" if is_gguf(path) and not on_gpu else "none"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}")
    if requested == "gguf" and not is_gguf(path):
        raise ValueError("quantization gguf needs a .gguf model file")
    if requested == MXFP4:
        raise ValueError("quantization mxfp4 needs an HF gpt-oss folder whose config.json has "
                         "quantization_config with quant_method mxfp4")
    if requested == METHOD:
        raise ValueError("quantization compressed-tensors needs an HF folder whose config.json has "
                         "quantization_config with quant_method compressed-tensors")
    if requested == "int8" and tp_size > 1:
        raise ValueError(f"quantization int8 is not sharded across ranks ({tp_size} ranks: "
                         "tensor_parallel_size x pipeline_parallel_size): under tensor parallelism "
                         "its per-token activation scales span each projection's whole input, which "
                         "a row-parallel rank does not hold, and pipeline stages do not load it "
                         "yet. Serve it on one rank, or a GGUF file quantized to Q8_0 "
                         "(--quantization gguf, sharded as stored), or --quantization none")
    if requested != "none" and on_gpu:
        raise ValueError(f"quantization {requested} runs on the CPU only (device cuda: pass "
                         "--quantization none)")
    return requested


def _mxfp4_quantization(requested: str | None, tp_size: int, on_gpu: bool) -> str:
    """gpt-oss's MXFP4 experts (mxfp4_load.py): served as stored, or a ValueError saying why not."""
    if requested not in (None, MXFP4):
        raise ValueError(f"quantization method specified in the model config ({MXFP4}) does not "
                         f"match the quantization argument ({requested}): omit --quantization or "
                         f"pass {MXFP4}")
    if tp_size > 1:
        raise ValueError("quantization mxfp4: MXFP4 experts are not sharded across ranks yet; "
                         "pass tensor_parallel_size 1")
    if on_gpu:
        raise ValueError("quantization mxfp4: MXFP4 experts run on the CPU only (pass --device cpu)")
    return MXFP4


def _checkpoint_quantization(method: str, requested: str | None, path: str, tp_size: int,
                             on_gpu: bool) -> str:
    """A checkpoint quantized by its maker: its own method or a ValueError saying why not."""
    if method != METHOD:
        raise ValueError(f"config.json: quantization_config quant_method {method!r} is not "
                         f"supported. {SUPPORTED}")
    if requested not in (None, METHOD):
        raise ValueError(f"quantization method specified in the model config ({METHOD}) does "
                         f"not match the quantization argument ({requested}): omit "
                         f"--quantization or pass {METHOD}")
    check_scheme(quantization_config(path))
    if tp_size > 1:
        raise ValueError(f"quantization {METHOD}: int8 checkpoints are not sharded across ranks "
                         f"({tp_size} ranks: tensor_parallel_size x pipeline_parallel_size): under "
                         "tensor parallelism their per-token activation scales span each "
                         "projection's whole input, which a row-parallel rank does not hold, and "
                         "pipeline stages do not load them yet. Serve it with tensor_parallel_size 1 "
                         "and pipeline_parallel_size 1")
    if on_gpu:
        raise ValueError(f"quantization {METHOD}: int8 checkpoints run on the CPU only "
                         "(pass --device cpu)")
    return METHOD


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class QuantizedEmbedding:
    """Token ids -> embedding rows, dequantised from the quantized table on lookup. With `tp`
    the table is this rank's vocab rows (vocab-parallel): ids outside them give zero rows, and
    the all-reduce over the ranks is the whole embedding (as tp_layers.vocab_parallel_embedding)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tp=None):
        self.weight, self.dtype, self.tp = weight, dtype, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w, ids = self.weight, ids.reshape(-1).long()
        if self.tp is None:
            return dequantize_rows(w.kind, w.packed, w.k, ids, self.dtype)
        local = ids - self.tp.rank * w.n
        outside = (local < 0) | (local >= w.n)
        x = dequantize_rows(w.kind, w.packed, w.k, local.masked_fill(outside, 0), self.dtype)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


def load_quantized_model(path: str, dtype: torch.dtype, quantization: str,
                         kernels: Kernels | None = None, arch: LlamaArchConfig | None = None,
                         tp=None, layers: range | None = None):
    """(model, arch), or None to load floats instead: a GGUF file with no quantized matrices,
    or no kernel library (no C compiler, or KVFLOW_NO_KERNELS=1). `arch`: the model's, where
    the caller resolved it. `tp` (a tensor-parallel group) and `layers` (a pipeline stage's):
    this rank's shard of a GGUF file only (gguf_shard.py), packed at each start."""
    kernels = select_kernels(dtype) if kernels is None else kernels
    if not kernels.options.c_kernels or library() is None:
        logger.warning("kvflow: quantization %s needs kvflow's C kernels; loading float weights",
                       quantization)
        return None
    isa = best_isa(kernels.features)
    arch = load_arch_config(path) if arch is None else arch
    if arch.num_experts or arch.qk_norm:
        logger.warning("kvflow: quantization %s serves dense Llama-family layers only (this model "
                       "has %s); loading float weights", quantization,
                       "experts" if arch.num_experts else "QK-norm")
        return None
    rank, size = (0, 1) if tp is None else (tp.rank, tp.world_size)
    sharded = tp is not None or layers is not None
    if sharded and quantization != "gguf":  # resolve_quantization refuses these first
        raise ValueError(f"quantization {quantization} is not sharded across ranks")
    rss0, t0 = rss_bytes(), time.perf_counter()
    if quantization == "gguf":
        from kvflow.model.quant.gguf_native import gguf_is_quantized, load_gguf_native

        def build():
            from gguf import GGUFReader

            if not gguf_is_quantized(GGUFReader(path)):
                raise _FloatFile
            if sharded:
                from kvflow.model.quant.gguf_shard import load_gguf_shard

                return load_gguf_shard(path, arch, dtype, isa, rank, size, layers)
            return load_gguf_native(path, dtype, isa)[1:]
        source_bytes = os.path.getsize(path)
    elif quantization == METHOD:
        from kvflow.model.quant.int8 import load_int8

        def build():
            return load_int8(path, dtype, isa, arch)[1:]
        source_bytes = _float_bytes(path)
    else:
        def build():
            return _int8_weights(path, dtype, isa, arch)
        source_bytes = _float_bytes(path)
    try:
        if is_gguf(path) and not sharded:  # packed once, then read from kvflow's cache
            from kvflow.model.quant.cache import cached_weights

            plain, quant = cached_weights(path, quantization, dtype, isa, build)
        else:
            plain, quant = build()
    except _FloatFile:
        return None
    shard = dict(tp=tp, layers=layers) if sharded else {}
    model = family_of(arch.architecture).model_class(arch)(arch, dtype, device="meta",
                                                          kernels=kernels, **shard)
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    left = set(missing) - set(quant)
    if left or unexpected:
        raise ValueError(f"quantized load: missing {sorted(left)}, unexpected {sorted(unexpected)}")
    model.eval()
    pack = kernels.pack or (lambda w, gate_up=False: None)
    for i, layer in enumerate(model.layers):  # a float projection (a checkpoint's ignored one)
        layer.packed = {p: PackedWeight(quant=quant[f"layers.{i}.{p}"])  # is packed as usual
                        if f"layers.{i}.{p}" in quant else pack(getattr(layer, p), gate_up=p == "gate_up_proj")
                        for p in _PROJECTIONS}
    if "lm_head" in quant:
        model.packed_lm_head = PackedWeight(quant=quant["lm_head"])
    elif getattr(model, "pp_last", True):
        model.packed_lm_head = pack(model.embed_tokens if model.lm_head is None else model.lm_head)
    if "embed_tokens" in quant and getattr(model, "pp_first", True):
        model.quantized_embedding = QuantizedEmbedding(quant["embed_tokens"], dtype, tp)
    weight_bytes = sum(w.nbytes for w in {id(w): w for w in quant.values()}.values())
    weight_bytes += sum(t.numel() * t.element_size() for t in plain.values())
    from kvflow.model.malloc_tuning import release_free_memory
    from kvflow.model.quant.gguf_native import describe

    release_free_memory()  # what packing freed goes back to the OS, not kept by malloc
    rss = rss_bytes()
    where = "" if not sharded else f" on rank {rank} of {size}" + (
        "" if layers is None else f", layers {layers.start}-{layers.stop - 1}")
    logger.info("kvflow: %s weights (%s) via %s%s: %.1f MB in memory (source %.1f MB); RSS %.1f MB "
                "after load (+%.1f MB), %.1f s", quantization, describe(quant), isa, where,
                weight_bytes / 1e6, source_bytes / 1e6, rss / 1e6, (rss - rss0) / 1e6,
                time.perf_counter() - t0)
    model.quant_report = {"weight_bytes": weight_bytes, "rss_after_load": rss, "isa": isa}
    # the start-up line names what serves the projections now
    model.kernels = dataclasses.replace(kernels, names={**kernels.names, "linear": f"quant-{isa}",
                                                        "gate_up": f"quant-{isa}+silu"})
    return model, arch


class _FloatFile(Exception):
    """The GGUF file holds no quantized matrices."""


def _float_bytes(path: str) -> int:
    """The size of a float model's weight files (the GGUF file itself)."""
    if is_gguf(path):
        return os.path.getsize(path)
    from kvflow.checkpoint.hf_folder import hf_weight_files

    files, bin_path = hf_weight_files(path)
    return sum(os.path.getsize(f) for f in files or [bin_path])


def _int8_weights(path: str, dtype: torch.dtype, isa: str, arch: LlamaArchConfig):
    """A float model's fused weights, the projections and LM head quantized to int8 W8A8 one by
    one (each float copy dropped as soon as its int8 one exists)."""
    from kvflow.checkpoint.conversion_cache import fuse_weights, load_gguf
    from kvflow.checkpoint.hf_folder import read_hf_folder
    from kvflow.model.quant.int8 import quantize_int8

    if is_gguf(path):
        weights = load_gguf(path, torch.float32)
    else:
        weights = fuse_weights(read_hf_folder(path, torch.float32), arch, torch.float32)
    quant = {}
    for name in [n for n in weights if n.rsplit(".", 1)[-1] in _PROJECTIONS]:
        quant[name] = quantize_int8(weights.pop(name), isa)
    head = weights.pop("lm_head", None)
    embed = weights.pop("embed_tokens")
    quant["embed_tokens"] = quantize_int8(embed, isa)
    quant["lm_head"] = quant["embed_tokens"] if head is None else quantize_int8(head, isa)
    del embed, head
    plain = {k: v.to(dtype) for k, v in weights.items()}
    return plain, quant
