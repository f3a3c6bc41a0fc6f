"""OpenAI's gpt-oss (GptOssForCausalLM) with float weights: the Llama decoder with q/k/v and
output projection biases, an attention sink per query head (kvflow/layers/attention.py), layers
alternating between a sliding window and the whole context (`layer_types`; by default the even
layers slide), YaRN RoPE (kvflow/layers/rotary.py) and a mixture of experts in every layer
(kvflow/layers/moe.py's GptOssMoeBlock: a biased router softmaxed over its top k, biased
experts with a clamped SwiGLU), as Hugging Face's GptOssModel computes it.

HF's checkpoint stores the experts as [experts, in, out] matrices with gate and up columns
interleaved (`gate_up_proj[..., ::2]` is the gate); they are split and transposed at load into
kvflow's [experts, out, in] with [gate; up] rows. The MXFP4 checkpoints the models ship as keep
their experts as stored (kvflow/model/quant/mxfp4_load.py, the same regrouping on the packed
blocks); llama.cpp's gpt-oss GGUF files likewise, their gate and up experts apart (gguf_*)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.layers.moe import GptOssMoeBlock
from kvflow.layers.parameter import weight
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention_pattern import hf_pattern_fields
from kvflow.models.llama import LlamaDecoderLayer, LlamaFamily, LlamaForCausalLM
from kvflow.models.registry import Supports

# transformers' GptOssConfig defaults, for configs that leave them out
_SLIDING_WINDOW, _SWIGLU_ALPHA, _SWIGLU_LIMIT = 128, 1.702, 7.0


@dataclass
class GptOssArchConfig(LlamaArchConfig):
    swiglu_alpha: float = _SWIGLU_ALPHA  # the experts' sigmoid gain
    swiglu_limit: float = _SWIGLU_LIMIT  # and their clamp

    def num_parameters(self) -> int:
        h, e, inter = self.hidden_size, self.num_experts, self.moe_intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + self.num_attention_heads  # + the sinks
        attention += (q + 2 * kv + h) if self.attention_bias else 0
        experts = e * (h + 1) + e * (3 * h * inter + 2 * inter + h)  # router, projections, biases
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + h + self.num_hidden_layers * (attention + experts + 2 * h)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with the output projection's bias, the attention sinks (fp32, one per
    query head) and gpt-oss's expert block."""

    moe_block = GptOssMoeBlock

    def __init__(self, arch: GptOssArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__(arch, dtype, device, tp, layer_idx=layer_idx)
        self.attn.sinks = weight(arch.num_attention_heads, dtype=torch.float32, device=device)
        if arch.attention_bias:
            self.o_bias = weight(arch.hidden_size, dtype=dtype, device=device)


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer


class GptOssFamily(LlamaFamily):
    name = "gpt-oss"
    gguf_reads_yarn = True
    default_sliding_window_pattern = 2  # llama.cpp's: the even layers slide
    # one rank, float weights, no adapters, layer by layer (not tested with the others yet)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, quantized=False,
                        decode_step=False)
    config_class = GptOssArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        return {"attention_bias": bool(cfg.get("attention_bias", True)), "qk_norm": False,
                "num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"]),
                "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),
                "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True,
                "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
                "swiglu_alpha": float(cfg.get("swiglu_alpha", _SWIGLU_ALPHA)),
                "swiglu_limit": float(cfg.get("swiglu_limit", _SWIGLU_LIMIT)),
                # every other layer slides (the even ones) where the config lists no layer types
                **hf_pattern_fields({"sliding_window": _SLIDING_WINDOW, **cfg}, default_pattern=2)}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """llama.cpp's gpt-oss keys: the experts, YaRN (its betas where the file has them, else
        gpt-oss's; untruncated, as the published config), the window from gguf_pattern_fields."""
        return {"num_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
                "moe_intermediate_size": int(meta("expert_feed_forward_length")), "norm_topk_prob": True,
                "qk_norm": False, "attention_bias": True,
                "rope_scaling": {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
                                 "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                                 "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                                 "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)),
                                 "truncate": False}}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        # the experts stay stacked [E, out, in], gate and up apart (fuse_experts joins them)
        return {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
                "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}

    def gguf_tensor(self, name: str, w, arch: LlamaArchConfig):
        return (name[: -len(".weight")], w) if name.endswith("self_attn.sinks.weight") else (name, w)

    def hf_layer_names(self, i: int, arch: GptOssArchConfig) -> dict[str, list[str]]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names = {"input_layernorm": [p + "input_layernorm.weight"],
                 "post_attention_layernorm": [p + "post_attention_layernorm.weight"],
                 "qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "o_proj.weight"],
                 "attn.sinks": [a + "sinks"]}
        if arch.attention_bias:
            names["qkv_bias"] = [a + f"{x}_proj.bias" for x in "qkv"]
            names["o_bias"] = [a + "o_proj.bias"]
        return names

    def fuse_experts(self, get, arch: GptOssArchConfig, i: int) -> dict[str, torch.Tensor]:
        """The router and its bias; the experts' interleaved [E, H, 2I] gate_up as [E, 2I, H]
        rows [gate; up] (its bias likewise), the down [E, I, H] as [E, H, I]; or a GGUF file's
        gate, up and down, already [E, out, in]."""
        p, q = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
        out = {q + "router": get(p + "router.weight"), q + "router_bias": get(p + "router.bias")}
        e = p + "experts."
        if get.has(e + "gate_proj.weight"):  # llama.cpp's: gate, up [E, I, H] and down [E, H, I] apart
            return {**out, q + "gate_up": torch.cat([get(e + "gate_proj.weight"), get(e + "up_proj.weight")], dim=1),
                    q + "gate_up_bias": torch.cat([get(e + "gate_proj.bias"), get(e + "up_proj.bias")], dim=1),
                    q + "down": get(e + "down_proj.weight"), q + "down_bias": get(e + "down_proj.bias")}
        gate_up, gate_up_bias = get(e + "gate_up_proj"), get(e + "gate_up_proj_bias")
        return {**out, q + "gate_up": torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=2).transpose(1, 2),
                q + "gate_up_bias": torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1),
                q + "down": get(e + "down_proj").transpose(1, 2), q + "down_bias": get(e + "down_proj_bias")}

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: GptOssArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().fuse_weights(hf, arch, dtype)
        for i in range(arch.num_hidden_layers):  # the kernels take the sinks in fp32
            out[f"layers.{i}.attn.sinks"] = out[f"layers.{i}.attn.sinks"].float()
        return out

    def model_class(self, arch: LlamaArchConfig) -> type[LlamaForCausalLM]:
        return GptOssForCausalLM


FAMILY = GptOssFamily()
