"""A quantized GGUF file loaded as it is stored: the projections, the LM head and the
embedding stay in their block formats (packed once into gemm_quant.c's panels); only the
norms and biases become floats. Read tensor by tensor from the memory-mapped file, so the
process never holds a float copy of the model."""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from kvflow.checkpoint.gguf import hf_name, unpermute_qk
from kvflow.checkpoint.gguf_blocks import as_q4, decode, to_q8
from kvflow.model.arch import LlamaArchConfig, arch_from_gguf_reader, save_arch_cache
from kvflow.model.quant.packing import PANEL, pack, pack_parts
from kvflow.model.quant.qlinear import QuantizedWeight
from kvflow.models.registry import family_of

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def gguf_is_quantized(reader) -> bool:
    """Any of the file's weight matrices is in a block format (not F32/F16/BF16)."""
    return any(t.tensor_type.name not in FLOAT_TYPES and len(t.shape) == 2 for t in reader.tensors)


def _quantized(parts: list[tuple], n_k: tuple[int, int], isa: str, source: str) -> QuantizedWeight:
    """The (kind, q, d, m) parts of one projection, stacked by outputs, packed: in their kind
    where they share one; where they differ (a Q4_K_M qkv with a Q6_K v), each part in its own
    kind (pack_parts) where all but the last fill whole panels of 16, else as q4 (4-bit parts)
    or requantized to q8."""
    kinds = {p[0] for p in parts}
    if len(kinds) > 1 and all(p[1].shape[0] % PANEL == 0 for p in parts[:-1]):
        packed = pack_parts([(p[0], p[1].shape[0], pack(*p)) for p in parts])
        return QuantizedWeight(kind="parts", n=n_k[0], k=n_k[1], packed=packed, isa=isa, source=source)
    if len(kinds) > 1 and kinds <= {"q4", "q4s", "q4k"}:  # all as q4, a d and m per 32
        parts = [as_q4(*p) for p in parts]
        kinds = {"q4"}
    if len(kinds) == 1:
        kind = kinds.pop()
        q = np.concatenate([p[1] for p in parts])
        d = np.concatenate([p[2] for p in parts])
        m = np.concatenate([p[3] for p in parts]) if kind in ("q4", "q6", "q4k") else None
    else:  # parts of different kinds, not on whole panels: all requantized to q8
        kind = "q8"
        pairs = [to_q8(*p) for p in parts]
        q, d, m = np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs]), None
    return QuantizedWeight(kind=kind, n=n_k[0], k=n_k[1], packed=pack(kind, q, d, m), isa=isa,
                           source=source)


def load_gguf_native(path: str, dtype: torch.dtype, isa: str
                     ) -> tuple[LlamaArchConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(arch, float tensors under kvflow's names, quantized weights under kvflow's names:
    layers.{i}.qkv_proj/o_proj/gate_up_proj/down_proj, embed_tokens, lm_head)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = arch_from_gguf_reader(reader, path)
    save_arch_cache(arch, path)  # later starts read it without parsing the file
    family = family_of(arch.architecture)
    permute = family.gguf_permutes_qk(arch.architecture)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is not None:
            tensors[name] = t

    def floats(name: str) -> torch.Tensor:
        t = tensors.pop(name)
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        return torch.from_numpy(a).to(dtype)

    def part(name: str, heads: int | None = None) -> tuple:
        t = tensors.pop(name)
        k, n = (int(x) for x in t.shape)
        kind, q, d, m = decode(t.data, t.tensor_type.name, n, k)
        if heads is not None:
            q, d = unpermute_qk(q, heads), unpermute_qk(d, heads)
            m = None if m is None else unpermute_qk(m, heads)
        return kind, q, d, m, t.tensor_type.name

    def weight(names: list[str], heads: list) -> QuantizedWeight:
        parts = [part(nm, h) for nm, h in zip(names, heads)]
        n, k = sum(p[1].shape[0] for p in parts), parts[0][1].shape[1]
        source = "+".join(sorted({p[4] for p in parts}))
        return _quantized([p[:4] for p in parts], (n, k), isa, source)

    plain: dict[str, torch.Tensor] = {"norm": floats("model.norm.weight")}
    quant: dict[str, QuantizedWeight] = {}
    for i in range(arch.num_hidden_layers):
        for name, hf_parts in family.hf_layer_names(i, arch).items():
            if name not in _PROJECTIONS:  # norms and biases stay floats
                plain[f"layers.{i}.{name}"] = torch.cat([floats(h) for h in hf_parts])
                continue
            heads = [None] * len(hf_parts)
            if name == "qkv_proj" and permute:
                heads = [arch.num_attention_heads, arch.num_key_value_heads, None]
            quant[f"layers.{i}.{name}"] = weight(hf_parts, heads)
    quant["embed_tokens"] = weight(["model.embed_tokens.weight"], [None])
    quant["lm_head"] = (quant["embed_tokens"] if arch.tie_word_embeddings
                        else weight(["lm_head.weight"], [None]))
    del reader, tensors  # unmaps the file
    return arch, plain, quant


def describe(quant: dict[str, QuantizedWeight]) -> str:
    """`Q4_1->q4 x210, Q8_0->q8 x1` for the load report."""
    seen = {id(w): w for w in quant.values()}.values()
    counts = Counter(f"{w.source}->{w.kind}" for w in seen)
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
