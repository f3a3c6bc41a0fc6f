"""gpt-oss as published: an HF folder whose config.json has `quantization_config` with
`quant_method: mxfp4` (transformers' Mxfp4Config), the experts' projections stored as
`model.layers.N.mlp.experts.{gate_up,down}_proj_{blocks,scales}` and everything else (attention,
router, biases, embedding, LM head) in floats. The experts are served as stored: each
expert's blocks are read with plain reads (kvflow/checkpoint/safetensors_reads.py: no mapping
of the file, whose pages would count in RSS beside the panels), regrouped into kvflow's
[gate; up] rows and packed into MXFP4 panels (kvflow/model/quant/mxfp4.py; no larger than the
file's bytes) at their place in one buffer of every expert's panels, then dropped: no float or
second copy of an expert ever exists and the process peaks near the file's size
(docs/quantization.md has the numbers). The floats load as a float gpt-oss's do (the family's
fuse_weights), with the experts' float weights left on the meta device.

llama.cpp's gpt-oss GGUF files (their experts in GGUF's MXFP4 blocks, gate and up apart) load the
same way from the memory-mapped file, into the same panels, each expert's mapped pages dropped
from the process once copied.

Without kvflow's C kernels (no compiler, KVFLOW_NO_KERNELS=1) the experts are dequantised to
floats instead, with a warning, as transformers does on machines without its MXFP4 kernels."""
from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import time

import numpy as np
import torch

from kvflow.checkpoint.hf_folder import hf_weight_files
from kvflow.checkpoint.safetensors_reads import StoredTensor, index_files, read_numpy, read_tensor
from kvflow.csrc import library
from kvflow.model.arch import LlamaArchConfig
from kvflow.model import hugepages
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.malloc_tuning import release_free_memory
from kvflow.model.packed_linear import PackedWeight
from kvflow.model.quant.load import MXFP4_FAMILIES, rss_bytes
from kvflow.model.quant.mxfp4 import dequantize, gguf_codes, hf_expert, mxfp4_weight
from kvflow.model.quant.packing import BLOCK, PANEL, RECORD_BYTES
from kvflow.model.quant.qlinear import best_isa
from kvflow.model_path import is_gguf
from kvflow.models.registry import family_of

logger = logging.getLogger("kvflow")
_SUFFIXES = ("_blocks", "_scales")


def _experts(where: dict[str, StoredTensor], prefix: str, gate_up: bool):
    """Per expert, (codes, e8m0) of `prefix`_blocks / _scales, read one expert's slice at a
    time with plain reads (a whole layer's blocks are 400 MB in gpt-oss-20b, their codes twice
    that; a mapping of the file would keep every page read in RSS)."""
    for name in (prefix + "_blocks", prefix + "_scales"):
        if name not in where:
            raise ValueError(f"weight {name!r} is missing from the MXFP4 checkpoint")
    blocks, scales = where[prefix + "_blocks"], where[prefix + "_scales"]
    for e in range(blocks.shape[0]):
        yield hf_expert(read_numpy(blocks, e), read_numpy(scales, e), gate_up)


def _gguf_parts(path: str, dtype: torch.dtype, arch: LlamaArchConfig):
    """llama.cpp's gpt-oss file: (float tensors under HF names, the experts' float weights on
    the meta device; per layer, its experts' (codes, e8m0) of [gate; up] and of down), or None
    where its experts are not MXFP4 (then it loads as floats)."""
    from kvflow.checkpoint.gguf import read_gguf

    raw: dict = {}
    _, arrays = read_gguf(path, raw_types=("MXFP4",), raw=raw)
    h, inter, n = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    names = [f"model.layers.{i}.mlp.experts.{x}_proj.weight" for i in range(arch.num_hidden_layers)
             for x in ("gate", "up", "down")]
    if any(name not in raw for name in names):
        return None
    hf = {k: torch.tensor(v).to(dtype) for k, v in arrays.items()}
    if arrays:
        _release_pages(next(iter(arrays.values())))
    del arrays

    def gate_up(gate, up):  # [gate; up] rows, one expert at a time
        for x in range(n):
            (gc, ge), (uc, ue) = gguf_codes(gate.data[x], inter, h), gguf_codes(up.data[x], inter, h)
            _release_pages(gate.data)  # copied: the mapped pages leave this process's RSS
            yield np.concatenate([gc, uc]), np.concatenate([ge, ue])

    def down_proj(down):
        for x in range(n):
            codes = gguf_codes(down.data[x], h, inter)
            _release_pages(down.data)
            yield codes

    layers = []
    for i in range(arch.num_hidden_layers):
        e = f"model.layers.{i}.mlp.experts."
        gate, up, down = (raw[e + f"{x}_proj.weight"] for x in ("gate", "up", "down"))
        layers.append((gate_up(gate, up), down_proj(down)))
        for x, shape in (("gate", (n, inter, h)), ("up", (n, inter, h)), ("down", (n, h, inter))):
            hf[e + f"{x}_proj.weight"] = torch.empty(shape, dtype=dtype, device="meta")
    return hf, layers


def _release_pages(array: np.ndarray) -> None:
    """Drop the pages of the file mapping under `array` (a view of the memory-mapped GGUF file)
    from this process: what was read from it has been copied, and a mapped page counts in RSS
    for as long as it stays mapped (the page cache keeps it; a later read faults it back)."""
    base = array
    while base is not None and getattr(base, "_mmap", None) is None:
        base = getattr(base, "base", None)
    mapping = getattr(base, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def load_mxfp4_model(path: str, dtype: torch.dtype, kernels: Kernels | None,
                     arch: LlamaArchConfig) -> tuple[torch.nn.Module, LlamaArchConfig] | None:
    """(model, arch) of an MXFP4 gpt-oss folder or llama.cpp gpt-oss file, its experts served by
    gemm_mxfp4.c; None for a GGUF file whose experts are not MXFP4 or where the C kernels are
    missing (the caller loads it as floats)."""
    family = family_of(arch.architecture)
    if family.name not in MXFP4_FAMILIES:
        raise ValueError(f"quantization mxfp4: kvflow reads MXFP4 experts of gpt-oss only, not "
                         f"of {family.name}")
    kernels = select_kernels(dtype) if kernels is None else kernels
    isa = best_isa(kernels.features) if kernels.options.c_kernels and library() is not None else None
    if isa is None:
        logger.warning("kvflow: MXFP4 experts need kvflow's C kernels; dequantising them to %s", dtype)
    rss0, t0 = rss_bytes(), time.perf_counter()
    if is_gguf(path):
        parts = _gguf_parts(path, dtype, arch) if isa is not None else None
        if parts is None:
            return None
        return _finish(path, parts[0], parts[1], family, arch, dtype, kernels, isa, rss0, t0,
                       os.path.getsize(path))
    where = index_files(hf_weight_files(path)[0])
    hf = {name: read_tensor(t).to(dtype) for name, t in where.items() if not name.endswith(_SUFFIXES)}
    h, inter, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    layers = []
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up, down = _experts(where, p + "gate_up_proj", True), _experts(where, p + "down_proj", False)
        if isa is None:  # HF's float layout: gate_up [E, H, 2I] (columns interleaved), down [E, I, H]
            g = torch.stack([dequantize(*x).to(dtype) for x in gate_up])  # [E, 2I, H] as [gate; up]
            hf[p + "gate_up_proj"] = torch.stack([g[:, :inter], g[:, inter:]], dim=2).reshape(e, 2 * inter, h) \
                .transpose(1, 2)
            hf[p + "down_proj"] = torch.stack([dequantize(*x).to(dtype) for x in down]).transpose(1, 2)
            continue
        layers.append((gate_up, down))
        hf[p + "gate_up_proj"] = torch.empty(e, h, 2 * inter, dtype=dtype, device="meta")
        hf[p + "down_proj"] = torch.empty(e, inter, h, dtype=dtype, device="meta")
    if isa is None:
        model = _build(family, arch, dtype, kernels, family.fuse_weights(hf, arch, dtype))
        return model, arch
    return _finish(path, hf, layers, family, arch, dtype, kernels, isa, rss0, t0,
                   sum(os.path.getsize(f) for f in {t.file for t in where.values()}))


def _build(family, arch: LlamaArchConfig, dtype: torch.dtype, kernels: Kernels, plain: dict):
    model = family.model_class(arch)(arch, dtype, device="meta", kernels=kernels)
    model.load_state_dict(plain, strict=True, assign=True)
    model.eval()
    model.pack_weights()
    return model


def _finish(path: str, hf: dict, layers: list, family, arch: LlamaArchConfig, dtype: torch.dtype,
            kernels: Kernels, isa: str, rss0: int, t0: float, source_bytes: int):
    """Pack each layer's experts (one at a time, as the iterators give them), build the model on
    the floats, hand each expert block its MXFP4 weights, report the load."""
    experts = _pack_experts(layers, arch, isa)
    plain = family.fuse_weights(hf, arch, dtype)
    del hf
    model = _build(family, arch, dtype, kernels, plain)
    release_free_memory()  # the experts' packing temporaries and the unfused floats
    for layer, pairs in zip(model.layers, experts):
        layer.moe.packed_experts = [{"gate_up": PackedWeight(quant=g), "down": PackedWeight(quant=d)}
                                    for g, d in pairs]
    expert_bytes = sum(g.nbytes + d.nbytes for pairs in experts for g, d in pairs)
    float_bytes = sum(t.numel() * t.element_size() for t in plain.values() if not t.is_meta)
    rss = rss_bytes()
    logger.info("kvflow: mxfp4 experts via %s: %.1f MB (+ %.1f MB of floats) in memory (source "
                "%.1f MB); RSS %.1f MB after load (+%.1f MB), %.1f s", isa, expert_bytes / 1e6,
                float_bytes / 1e6, source_bytes / 1e6, rss / 1e6, (rss - rss0) / 1e6,
                time.perf_counter() - t0)
    model.quant_report = {"expert_bytes": expert_bytes, "weight_bytes": expert_bytes + float_bytes,
                          "rss_after_load": rss, "isa": isa}
    model.kernels = dataclasses.replace(kernels, names={**kernels.names, "experts": f"mxfp4-{isa}"})
    return model, arch


def _panel_bytes(n: int, k: int) -> int:
    return -(-n // PANEL) * (k // BLOCK) * RECORD_BYTES["mxfp4"]


def _pack_experts(layers: list, arch: LlamaArchConfig, isa: str) -> list[list[tuple]]:
    """Each expert's (gate_up, down) MXFP4 weights, packed one at a time into their place in
    one buffer of every expert's panels (on 2 MiB pages where the OS grants them: decode
    streams the panels). Each expert's codes and packing temporaries are the same sizes as
    the last one's, so malloc hands the same memory back: the process holds the panels, the
    floats, and one expert in flight, never a second copy of the experts."""
    h, inter = arch.hidden_size, arch.moe_intermediate_size
    sizes = _panel_bytes(2 * inter, h), _panel_bytes(h, inter)
    arena = hugepages.zeros(len(layers) * arch.num_experts * sum(sizes), torch.uint8)
    offset, experts = 0, []
    for gate_up, down in layers:
        pairs = []
        for parts in zip(gate_up, down):
            pair = []
            for (codes, e8m0), size in zip(parts, sizes):
                w = mxfp4_weight(codes, e8m0, isa)
                assert w.nbytes == size, (w.nbytes, size)
                slot = arena[offset:offset + size]
                slot.copy_(w.packed)
                pair.append(dataclasses.replace(w, packed=slot))
                offset += size
            pairs.append(tuple(pair))
        experts.append(pairs)
    return experts
