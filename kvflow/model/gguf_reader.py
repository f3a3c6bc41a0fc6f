"""GGUF file -> (architecture, float32 weights under Hugging Face names)."""
from __future__ import annotations

import re

import numpy as np

from kvflow.model.arch import LlamaArchConfig, arch_from_gguf_reader

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
}
# Gemma 3's four norms per layer and its QK-norm (llama.cpp's names)
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES,
                       "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm",
                       "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors kvflow does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if architecture == "Gemma3ForCausalLM" else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q/k (interleaved -> HF half-split RoPE)."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str) -> tuple[LlamaArchConfig, dict[str, np.ndarray]]:
    """Dequantise every tensor (Q4_*/Q8_0/F16/BF16/F32...) to float32 with HF names and shapes."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = arch_from_gguf_reader(reader, path)
    permute = arch.architecture == "LlamaForCausalLM"  # llama.cpp permutes q/k only for llama
    # llama.cpp stores Gemma's norm weights as 1 + w; back to HF's w, as transformers does
    norm_shift = 1.0 if arch.architecture == "Gemma3ForCausalLM" else 0.0
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch.architecture)
        if name is None:
            continue
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost first; numpy's row-major shape is the reverse = HF's (out, in)
        w = w.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if permute and ".q_proj." in name:
            w = unpermute_qk(w, arch.num_attention_heads)
        elif permute and ".k_proj." in name:
            w = unpermute_qk(w, arch.num_key_value_heads)
        if norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(norm_shift)
        weights[name] = w
    return arch, weights
