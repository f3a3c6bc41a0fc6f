"""The Llama family and its close relatives, one decoder (kvflow/model/llama.py): Llama 2/3,
SmolLM, Mistral, Qwen2 (q/k/v biases), Qwen3 (QK-norm), Phi-3 (LongRoPE, partial rotary, q/k/v
and gate/up fused in its checkpoints) and the mixture-of-experts Qwen3-MoE, Mixtral and
Qwen2-MoE (kvflow/model/moe.py). Their config fields, HF and GGUF weight names, and what they
support."""
from __future__ import annotations

import torch

from kvflow.model.arch import LlamaArchConfig
from kvflow.model.llama import LlamaForCausalLM
from kvflow.models.family import ModelFamily
from kvflow.models.registry import Supports

_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_BIASED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v biases without attention_bias
_FUSED_IN_CHECKPOINT = "Phi3ForCausalLM"
_MIXTRAL = "MixtralForCausalLM"
# llama.cpp's choice where the file does not say (expert_weights_norm): Qwen2-MoE leaves the
# top-k weights as they come out of the softmax, Qwen3-MoE and Mixtral renormalise them.
_GGUF_NORM_TOPK = {"Qwen2MoeForCausalLM": False}


class LlamaFamily(ModelFamily):
    name = "Llama"
    supports = Supports()

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        fields = {"qk_norm": architecture in _QK_NORM,
                  "attention_bias": bool(cfg.get("attention_bias", cfg.get("qkv_bias", architecture in _BIASED)))}
        if architecture == _MIXTRAL:
            fields.update(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                          moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        elif architecture in _QWEN_MOE:
            fields.update(
                num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []])
        return fields

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        experts = int(meta("expert_count", 0) or 0)
        if not experts:
            return {}
        if architecture == "LlamaForCausalLM":  # llama.cpp's "llama" with experts is Mixtral
            architecture = _MIXTRAL
        return {"architecture": architecture, "num_experts": experts,
                "num_experts_per_tok": int(meta("expert_used_count")),
                "moe_intermediate_size": int(meta("expert_feed_forward_length", meta("feed_forward_length"))),
                "norm_topk_prob": bool(meta("expert_weights_norm", _GGUF_NORM_TOPK.get(architecture, True))),
                "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0)),
                # layers without a router keep a dense MLP
                "mlp_only_layers": [i for i in range(int(meta("block_count")))
                                    if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        if architecture == _FUSED_IN_CHECKPOINT:
            return {"ffn_up": "mlp.gate_up_proj"}  # [gate; up], as Phi-3's HF checkpoint
        if architecture == _MIXTRAL:
            return {"ffn_gate_inp": "block_sparse_moe.gate"}
        return {}

    def gguf_permutes_qk(self, architecture: str) -> bool:
        return architecture in ("LlamaForCausalLM", _MIXTRAL)  # llama.cpp's "llama" only

    def hf_layer_names(self, i: int, arch: LlamaArchConfig) -> dict[str, list[str]]:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        fused = arch.architecture == _FUSED_IN_CHECKPOINT
        names = {"input_layernorm": [p + "input_layernorm.weight"],
                 "post_attention_layernorm": [p + "post_attention_layernorm.weight"],
                 "qkv_proj": [a + "qkv_proj.weight"] if fused else [a + f"{x}_proj.weight" for x in "qkv"],
                 "o_proj": [a + "o_proj.weight"]}
        if arch.attention_bias:
            names["qkv_bias"] = [a + f"{x}_proj.bias" for x in "qkv"]
        if arch.qk_norm:
            names["q_norm"], names["k_norm"] = [a + "q_norm.weight"], [a + "k_norm.weight"]
        if not arch.is_moe_layer(i):
            names["gate_up_proj"] = [m + "gate_up_proj.weight"] if fused else [m + "gate_proj.weight", m + "up_proj.weight"]
            names["down_proj"] = [m + "down_proj.weight"]
        return names

    def expert_names(self, i: int, arch: LlamaArchConfig) -> tuple[str, str, str, str, str]:
        """Layer i's expert block: (its prefix, the router, and each expert's gate, up and down
        as formats of the expert's number)."""
        if arch.architecture == _MIXTRAL:
            p = f"model.layers.{i}.block_sparse_moe."
            return p, p + "gate.weight", p + "experts.{}.w1.weight", p + "experts.{}.w3.weight", \
                p + "experts.{}.w2.weight"
        p = f"model.layers.{i}.mlp."
        return p, p + "gate.weight", p + "experts.{}.gate_proj.weight", p + "experts.{}.up_proj.weight", \
            p + "experts.{}.down_proj.weight"

    def fuse_experts(self, get, arch: LlamaArchConfig, i: int) -> dict[str, torch.Tensor]:
        """The router, every expert's [gate; up] and down stacked into [experts, ...] tensors,
        and Qwen2-MoE's shared expert with its gate."""
        p, router, gate, up, down = self.expert_names(i, arch)
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

    def model_class(self, arch: LlamaArchConfig) -> type[torch.nn.Module]:
        return LlamaForCausalLM


FAMILY = LlamaFamily()
