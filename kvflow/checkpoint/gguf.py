"""GGUF file -> (architecture, float32 weights under Hugging Face names).

The names are llama.cpp's (convert_hf_to_gguf.py, gguf-py's tensor_mapping.py): the common
table is here, each family's differences in its file in kvflow/models/ (Phi-3 keeps its fused
`attn_qkv` and `ffn_up` = [gate; up]; Gemma 3 has four norms per layer). A mixture-of-experts
layer stores each projection of all its experts as one 3-D tensor (`ffn_gate_exps` ...), split
here into the family's per-expert HF names."""
from __future__ import annotations

import re

import numpy as np

from kvflow.model.arch import LlamaArchConfig, arch_from_gguf_reader
from kvflow.models.registry import family_of

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_EXPERT_KINDS = {"ffn_gate_exps": 2, "ffn_up_exps": 3, "ffn_down_exps": 4}  # in expert_names' tuple
# (LFM2's `shortconv.conv`; the state layers' `ssm_a` and `ssm_d` have no suffix)
_LAYER_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")
# Mixtral files from before llama.cpp stacked the experts: one tensor per expert
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_name(gguf_name: str, arch: LlamaArchConfig) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors kvflow does not use (and for
    the 3-D expert tensors, which expert_names splits)."""
    family = family_of(arch.architecture)
    globals_ = {**_GLOBAL_NAMES, **family.gguf_global_names}
    if gguf_name in globals_:
        return globals_[gguf_name]
    legacy = _LEGACY_EXPERT_RE.fullmatch(gguf_name)
    if legacy is not None and arch.num_experts:
        layer, kind, e = legacy.groups()
        return family.expert_names(int(layer), arch)[_EXPERT_KINDS[f"ffn_{kind}_exps"]].format(e)
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None:
        return None
    names = {**_LAYER_NAMES, **family.gguf_layer_names(arch.architecture)}
    if m.group(2) not in names:
        return None
    suffix = "" if m.group(3) is None else "." + m.group(3)
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}{suffix}"


def expert_names(gguf_name: str, arch: LlamaArchConfig) -> list[str] | None:
    """HF names of the experts stacked in a GGUF `blk.N.ffn_*_exps` tensor, in order (None for
    any other tensor)."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _EXPERT_KINDS:
        return None
    if m.group(2) in family_of(arch.architecture).gguf_layer_names(arch.architecture):
        return None  # the family keeps this one stacked, under its own name (gpt-oss)
    fmt = family_of(arch.architecture).expert_names(int(m.group(1)), arch)[_EXPERT_KINDS[m.group(2)]]
    return [fmt.format(e) for e in range(arch.num_experts)]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q/k (interleaved -> HF half-split RoPE)."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str, raw_types: tuple[str, ...] = (), raw: dict | None = None,
              convert=None) -> tuple[LlamaArchConfig, dict[str, np.ndarray]]:
    """Dequantise every tensor (Q4_*/Q8_0/F16/BF16/F32...) to float32 with HF names and shapes;
    tensors of `raw_types` (GGUF type names) go to `raw` under their HF names as the reader's
    tensors instead, their blocks untouched (gpt-oss's MXFP4 experts, served as stored).
    `convert` (an array -> what is kept) applies to each tensor as soon as it is read, so
    that the whole model is never held in float32 (a 3-D expert tensor: to each expert)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = arch_from_gguf_reader(reader, path)
    family = family_of(arch.architecture)
    permute = family.gguf_permutes_qk(arch.architecture)
    norm_shift = family.gguf_norm_shift
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        experts = expert_names(tensor.name, arch)
        if name is None and experts is None:
            continue
        if tensor.tensor_type.name in raw_types and name is not None:
            raw[name] = tensor
            continue
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost first; numpy's row-major shape is the reverse = HF's (out, in)
        w = w.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if experts is not None:  # [experts, out, in]
            weights.update(zip(experts, w if convert is None else map(convert, w)))
            continue
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores this [1, hidden] row as a vector
        if permute and ".q_proj." in name:
            w = unpermute_qk(w, arch.num_attention_heads)
        elif permute and ".k_proj." in name:
            w = unpermute_qk(w, arch.num_key_value_heads)
        if norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(norm_shift)
        name, w = family.gguf_tensor(name, w, arch)
        weights[name] = w if convert is None else convert(w)
    return arch, weights
