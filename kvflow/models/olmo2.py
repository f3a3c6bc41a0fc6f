"""AI2's OLMo 2 (Olmo2ForCausalLM): a Llama-shaped decoder whose norms come after each
sublayer instead of before it, as Hugging Face's Olmo2DecoderLayer computes:

    x = x + post_attention_layernorm(attention(x))
    x = x + post_feedforward_layernorm(mlp(x))

and whose QK-norm is one RMSNorm over the whole q (and the whole k) projection, across heads,
before RoPE. llama.cpp's `olmo2` GGUF files name the norms `post_attention_norm`,
`post_ffw_norm`, `attn_q_norm` and `attn_k_norm`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.attention import Attention
from kvflow.layers.parameter import weight
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kernels import Kernels
from kvflow.models.llama import LlamaFamily, LlamaForCausalLM
from kvflow.models.registry import Supports


@dataclass
class Olmo2ArchConfig(LlamaArchConfig):
    def num_parameters(self) -> int:
        # the QK-norm weights span the whole projections, not one head_dim each
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return super().num_parameters() - 2 * self.head_dim * self.num_hidden_layers * self.qk_norm \
            + (q + kv) * self.num_hidden_layers


class Olmo2DecoderLayer(nn.Module):
    """One post-norm decoder layer; forward as LlamaDecoderLayer's: (x, the residual delta not
    yet added)."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, d, d ** -0.5,
                              arch.layer_windows()[layer_idx])
        q_size, kv_size = self.attn.q_size, self.attn.kv_size
        self.eps = arch.rms_norm_eps
        self.qkv_proj = weight(q_size + 2 * kv_size, h, dtype=dtype, device=device)
        self.o_proj = weight(h, q_size, dtype=dtype, device=device)
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device)
        self.q_norm = weight(q_size, dtype=dtype, device=device)
        self.k_norm = weight(kv_size, dtype=dtype, device=device)
        self.post_attention_layernorm = weight(h, dtype=dtype, device=device)
        self.post_feedforward_layernorm = weight(h, dtype=dtype, device=device)
        self.moe, self.qkv_bias, self.lora_slots = None, None, None
        self.packed: dict = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual_delta is not None:
            x.add_(residual_delta)
        pk, a = self.packed, self.attn
        q_end, k_end = a.q_size, a.q_size + a.kv_size
        qkv = kernels.linear(x, self.qkv_proj, pk.get("qkv_proj"))
        qkv[:, :q_end] = kernels.add_rms_norm(qkv[:, :q_end].contiguous(), None, self.q_norm, self.eps)
        qkv[:, q_end:k_end] = kernels.add_rms_norm(qkv[:, q_end:k_end].contiguous(), None, self.k_norm, self.eps)
        kernels.rope(qkv, a.num_heads + a.num_kv_heads, a.head_dim, *rope)
        attn = a(qkv, kv_cache, meta, kernels)
        o = kernels.linear(attn, self.o_proj, pk.get("o_proj"))
        x.add_(kernels.add_rms_norm(o, None, self.post_attention_layernorm, self.eps))
        act = kernels.linear_silu_mul(x, self.gate_up_proj, pk.get("gate_up_proj"))
        down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        return x, kernels.add_rms_norm(down, None, self.post_feedforward_layernorm, self.eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """The Llama module (embedding, RoPE tables, LM head) over OLMo 2's layers."""

    decoder_layer = Olmo2DecoderLayer


class Olmo2Family(LlamaFamily):
    name = "OLMo 2"
    # QK-norm across heads would need an all-reduce under TP; one rank, floats, no adapters
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False,
                        quantized=False, decode_step=False)
    config_class = Olmo2ArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        if cfg.get("attention_bias"):
            raise ValueError("OLMo 2 with attention_bias is not supported")
        return {"qk_norm": True, "attention_bias": False}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        return {"post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

    def hf_layer_names(self, i: int, arch: LlamaArchConfig) -> dict[str, list[str]]:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        return {"post_attention_layernorm": [p + "post_attention_layernorm.weight"],
                 "post_feedforward_layernorm": [p + "post_feedforward_layernorm.weight"],
                 "qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "o_proj.weight"],
                 "q_norm": [a + "q_norm.weight"], "k_norm": [a + "k_norm.weight"],
                 "gate_up_proj": [m + "gate_proj.weight", m + "up_proj.weight"],
                 "down_proj": [m + "down_proj.weight"]}

    def model_class(self, arch: LlamaArchConfig) -> type[LlamaForCausalLM]:
        return Olmo2ForCausalLM


FAMILY = Olmo2Family()
