"""Gemma 3's checkpoint names beyond the Llama part that kvflow/model/weights.py fuses: the
text part of a Gemma3ForConditionalGeneration checkpoint, and the norms (four per layer,
QK-norm), kept as their fp32 multipliers 1 + weight."""
from __future__ import annotations

import torch

from kvflow.model.arch import LlamaArchConfig

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def text_part(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under Gemma3ForCausalLM's names (vision tensors dropped
    by the fusing, which reads only the names it needs)."""
    out = {}
    for name, w in hf.items():
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        out[name.removeprefix("language_model.") if name.startswith("language_model.lm_head.") else name] = w
    return out


def gemma3_norms(hf: dict[str, torch.Tensor], arch: LlamaArchConfig) -> dict[str, torch.Tensor]:
    """kvflow's norm tensors: fp32 1 + weight, the factor HF's Gemma3RMSNorm multiplies by."""
    def multiplier(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        return (1.0 + hf[name].float()).contiguous()

    out = {"norm": multiplier("model.norm.weight")}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in LAYER_NORMS:
            out[f"layers.{i}.{n}"] = multiplier(p + n + ".weight")
        out[f"layers.{i}.q_norm"] = multiplier(p + "self_attn.q_norm.weight")
        out[f"layers.{i}.k_norm"] = multiplier(p + "self_attn.k_norm.weight")
    return out
