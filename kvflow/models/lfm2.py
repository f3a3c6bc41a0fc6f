"""Liquid AI's LFM2 (Lfm2ForCausalLM): a hybrid of gated short-convolution layers
(kvflow/layers/short_conv.py, a fixed-size state per request) and attention layers with
per-head QK-norm, each followed by a SwiGLU MLP, pre-norm, the final norm named
`embedding_norm`, as Hugging Face's Lfm2Model computes it. Only the attention layers hold a KV
cache; the conv layers hold a state slot per running request (the KV cache coordinator's state
group)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.parameter import weight
from kvflow.layers.short_conv import ShortConv
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kernels import Kernels
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.llama import LlamaDecoderLayer, LlamaFamily
from kvflow.models.registry import Supports



@dataclass
class Lfm2ArchConfig(LlamaArchConfig):
    conv_layers: list[int] = field(default_factory=list)  # the layers that convolve, not attend
    conv_kernel_size: int = 3  # HF's conv_L_cache
    conv_bias: bool = False

    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.conv_layers]

    def state_bytes_per_request(self, dtype_bytes: int) -> int:
        return len(self.conv_layers) * (self.conv_kernel_size - 1) * self.hidden_size * dtype_bytes

    def num_parameters(self) -> int:
        h, n_conv = self.hidden_size, len(self.conv_layers)
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + 2 * self.head_dim
        conv = 3 * h * h + h * h + h * self.conv_kernel_size + (5 * h if self.conv_bias else 0)
        per_layer = 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (embed + h + self.num_hidden_layers * per_layer
                + (self.num_hidden_layers - n_conv) * attention + n_conv * conv)


class Lfm2ConvLayer(nn.Module):
    """A conv layer: x + conv(norm(x)), then x + mlp(norm(x)); forward as LlamaDecoderLayer's
    (x, the MLP output not yet added)."""

    def __init__(self, arch: Lfm2ArchConfig, dtype: torch.dtype, device=None):
        super().__init__()
        h = arch.hidden_size
        self.eps = arch.rms_norm_eps
        self.conv = ShortConv(h, arch.conv_kernel_size, arch.conv_bias, dtype, device)
        self.input_layernorm = weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = weight(h, dtype=dtype, device=device)
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device)
        self.moe, self.lora_slots = None, None
        self.packed: dict = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache, meta: AttentionMetadata, kernels: Kernels,
                lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        pk = self.packed
        h = kernels.add_rms_norm(x, residual_delta, self.input_layernorm, self.eps)
        o = self.conv(h, meta, kernels, pk)
        act = kernels.norm_linear_silu_mul(x, o, self.post_attention_layernorm, self.eps,
                                           self.gate_up_proj, pk.get("gate_up_proj"))
        return x, kernels.linear(act, self.down_proj, pk.get("down_proj"))


def _layer(arch: Lfm2ArchConfig, dtype: torch.dtype, device=None, tp=None, layer_idx: int = 0) -> nn.Module:
    if layer_idx in arch.conv_layers:
        return Lfm2ConvLayer(arch, dtype, device)
    return LlamaDecoderLayer(arch, dtype, device, tp, layer_idx=layer_idx)


class Lfm2ForCausalLM(HybridForCausalLM):
    """The Llama module (embedding, RoPE tables, final norm, tied LM head) over LFM2's layers.
    `allocate_state` gives the conv layers their state slots before the first step."""

    decoder_layer = staticmethod(_layer)
    state_attr = "conv"

    def __init__(self, arch: Lfm2ArchConfig, dtype: torch.dtype, device=None, *args, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise ValueError("LFM2 runs on the CPU only for now (its conv layers have no GPU kernel)")
        super().__init__(arch, dtype, device, *args, **kwargs)


class Lfm2Family(LlamaFamily):
    name = "LFM2"
    # one rank, float weights, no adapters, layer by layer; no speculative decoding and no KV
    # transfer (a state cannot be rolled back or sent yet: the engine refuses them)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, quantized=False,
                        decode_step=False)
    config_class = Lfm2ArchConfig
    hf_global_names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.embedding_norm.weight",
                       "lm_head": "lm_head.weight"}

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or ["full_attention" if i in (cfg.get("full_attn_idxs") or range(n))
                                           else "conv" for i in range(n)]
        if len(types) != n or any(t not in ("conv", "full_attention") for t in types):
            raise ValueError(f"layer_types must list 'conv' or 'full_attention' for each of {n} layers")
        inter = cfg.get("block_ff_dim", cfg["intermediate_size"])
        if cfg.get("block_auto_adjust_ff_dim", True):  # HF's Lfm2MLP sizing
            inter = int(2 * inter / 3)
            if cfg.get("block_ffn_dim_multiplier") is not None:
                inter = int(cfg["block_ffn_dim_multiplier"] * inter)
                multiple = cfg.get("block_multiple_of", 256)
                inter = multiple * ((inter + multiple - 1) // multiple)
        return {"qk_norm": True, "attention_bias": False, "intermediate_size": inter,
                "rms_norm_eps": cfg.get("norm_eps", 1e-5),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
                "conv_layers": [i for i, t in enumerate(types) if t == "conv"],
                "conv_kernel_size": int(cfg.get("conv_L_cache", 3)), "conv_bias": bool(cfg.get("conv_bias", False))}

    gguf_global_names = {"token_embd_norm.weight": "model.embedding_norm.weight"}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """llama.cpp's `lfm2`: the conv layers are those with `shortconv` tensors (their
        head_count_kv is 0), the kernel `shortconv.l_cache`; the MLP width from ffn_gate."""
        n = int(meta("block_count"))
        conv = [i for i in range(n) if f"blk.{i}.shortconv.in_proj.weight" in tensors]
        gate = tensors["blk.0.ffn_gate.weight"]
        return {"conv_layers": conv, "conv_kernel_size": int(meta("shortconv.l_cache", 3)),
                "intermediate_size": int(gate.shape[1]), "qk_norm": True,
                "conv_bias": any(f"blk.{i}.shortconv.in_proj.bias" in tensors for i in conv)}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        return {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                "shortconv.out_proj": "conv.out_proj", "attn_norm": "operator_norm",
                "ffn_norm": "ffn_norm", "attn_q_norm": "self_attn.q_layernorm",
                "attn_k_norm": "self_attn.k_layernorm", "attn_output": "self_attn.out_proj",
                "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}

    def hf_layer_names(self, i: int, arch: Lfm2ArchConfig) -> dict[str, list[str]]:
        p = f"model.layers.{i}."
        m = p + "feed_forward."
        names = {"input_layernorm": [p + "operator_norm.weight"],
                 "post_attention_layernorm": [p + "ffn_norm.weight"],
                 "gate_up_proj": [m + "w1.weight", m + "w3.weight"], "down_proj": [m + "w2.weight"]}
        if i in arch.conv_layers:
            c = p + "conv."
            names.update({"conv.in_proj": [c + "in_proj.weight"], "conv.out_proj": [c + "out_proj.weight"],
                          "conv.conv_weight": [c + "conv.weight"]})
            if arch.conv_bias:
                names.update({"conv.in_bias": [c + "in_proj.bias"], "conv.out_bias": [c + "out_proj.bias"],
                              "conv.conv_bias": [c + "conv.bias"]})
            return names
        a = p + "self_attn."
        names.update({"qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "out_proj.weight"],
                      "q_norm": [a + "q_layernorm.weight"], "k_norm": [a + "k_layernorm.weight"]})
        return names

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: Lfm2ArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().fuse_weights(hf, arch, dtype)
        for i in arch.conv_layers:  # HF's Conv1d weight [hidden, 1, taps] -> [hidden, taps]
            name = f"layers.{i}.conv.conv_weight"
            out[name] = out[name].reshape(arch.hidden_size, arch.conv_kernel_size).contiguous()
        return out

    def model_class(self, arch: LlamaArchConfig) -> type[HybridForCausalLM]:
        return Lfm2ForCausalLM


FAMILY = Lfm2Family()
