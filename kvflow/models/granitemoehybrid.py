"""IBM's Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba2 layers (kvflow/layers/mamba2.py, a
fixed-size state per request) interleaved with attention layers, each followed by a mixture of
experts plus an always-on shared MLP (or the shared MLP alone where the config has no experts),
pre-norm, with Granite 3's multipliers (kvflow/models/granite.py): the embeddings times
`embedding_multiplier`, each mixer and MLP output times `residual_multiplier`, attention scores
scaled by `attention_multiplier`, the logits divided by `logits_scaling`; as Hugging Face's
GraniteMoeHybridModel computes them. Granite 4.0-H's attention has no position embedding
(`position_embedding_type` "nope"; "rope" rotates q and k as Llama does). The router takes the
top k of its logits and softmaxes those k (GraniteMoe's order). Only the attention layers hold a
KV cache; the Mamba2 layers hold a state slot per running request (the KV cache coordinator's
state group)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.mamba2 import Mamba2
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.parameter import weight
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kernels import Kernels
from kvflow.models.family import getter
from kvflow.models.granite import GraniteArchConfig, GraniteFamily
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.llama import LlamaDecoderLayer
from kvflow.models.registry import Supports

_MAMBA_TYPES, _ATTENTION_TYPES = ("mamba", "linear_attention"), ("attention", "full_attention")


@dataclass
class GraniteMoeHybridArchConfig(GraniteArchConfig):
    mamba_layers: list[int] = field(default_factory=list)  # the Mamba2 layers, not attention
    mamba_n_heads: int = 128
    mamba_d_head: int = 64
    mamba_d_state: int = 256
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_min: float = 0.0  # HF's time_step_limit: dt is clamped to it
    time_step_max: float = math.inf
    use_rope: bool = False  # position_embedding_type "rope" (Granite 4.0-H: "nope")

    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.mamba_layers]

    @property
    def mamba_conv_dim(self) -> int:
        """The conv channels: x | B | C."""
        return self.mamba_n_heads * self.mamba_d_head + 2 * self.mamba_n_groups * self.mamba_d_state

    def state_bytes_per_request(self, dtype_bytes: int) -> int:
        """Per Mamba2 layer: the conv window (kernel - 1 inputs in the model dtype) and the SSM
        state of every head, in fp32 whatever the model dtype (as HF's scan keeps it)."""
        window = (self.mamba_d_conv - 1) * self.mamba_conv_dim * dtype_bytes
        ssm = self.mamba_n_heads * self.mamba_d_head * self.mamba_d_state * 4
        return len(self.mamba_layers) * (window + ssm)

    def num_parameters(self) -> int:
        h, d, n_mamba = self.hidden_size, self.head_dim, len(self.mamba_layers)
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * (q + 2 * kv) + q * h
        inner, conv, nh = self.mamba_n_heads * self.mamba_d_head, self.mamba_conv_dim, self.mamba_n_heads
        mamba = (h * (inner + conv + nh) + conv * self.mamba_d_conv + 3 * nh + inner + inner * h
                 + (conv if self.mamba_conv_bias else 0) + ((inner + conv + nh + h) if self.mamba_proj_bias else 0))
        shared = 3 * h * self.intermediate_size  # the shared MLP (the dense MLP where no experts)
        experts = self.num_experts * (h + 3 * h * self.moe_intermediate_size)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (embed + h + self.num_hidden_layers * (2 * h + shared + experts)
                + (self.num_hidden_layers - n_mamba) * attention + n_mamba * mamba)


class GraniteMoeHybridMoE(SparseMoeBlock):
    """The experts (top k of the router's logits, softmaxed over those k) plus the shared MLP,
    ungated: HF's block_sparse_moe(h) + shared_mlp(h)."""

    def __init__(self, arch: GraniteMoeHybridArchConfig, dtype: torch.dtype, device=None):
        super().__init__(arch, dtype, device)
        self.shared_gate = None

    def route(self, h: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        logits = kernels.linear(h, self.router, self.packed.get("router")).float()
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(h.dtype), experts


class GraniteMoeHybridAttentionLayer(LlamaDecoderLayer):
    """An attention layer: Llama's, with Granite's multipliers, RoPE only where the config
    asks, and Granite's expert block."""

    def __init__(self, arch: GraniteMoeHybridArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__(arch, dtype, device, tp, layer_idx)
        self.use_rope = arch.use_rope
        self.attn.scale, self.residual_scale = arch.attention_multiplier, arch.residual_multiplier
        if self.moe is not None:
            self.moe = GraniteMoeHybridMoE(arch, dtype, device)


class GraniteMoeHybridMambaLayer(nn.Module):
    """A Mamba2 layer: x + r * mamba(norm(x)), then x + r * mlp(norm(x)) (r the residual
    multiplier); forward as LlamaDecoderLayer's (x, the MLP output not yet added)."""

    def __init__(self, arch: GraniteMoeHybridArchConfig, dtype: torch.dtype, device=None):
        super().__init__()
        h = arch.hidden_size
        self.eps, self.residual_scale = arch.rms_norm_eps, arch.residual_multiplier
        self.mamba = Mamba2(h, arch.mamba_n_heads, arch.mamba_d_head, arch.mamba_d_state, arch.mamba_n_groups,
                            arch.mamba_d_conv, arch.rms_norm_eps, arch.mamba_conv_bias, arch.mamba_proj_bias,
                            (arch.time_step_min, arch.time_step_max), dtype, device)
        self.input_layernorm = weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = weight(h, dtype=dtype, device=device)
        self.moe = GraniteMoeHybridMoE(arch, dtype, device) if arch.num_experts else None
        dense = self.moe is None
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device) if dense else None
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device) if dense else None
        self.lora_slots = None
        self.packed: dict = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache, meta: AttentionMetadata, kernels: Kernels,
                lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        pk = self.packed
        h = kernels.add_rms_norm(x, residual_delta, self.input_layernorm, self.eps)
        o = self.mamba(h, meta, kernels, pk).mul_(self.residual_scale)
        h = kernels.add_rms_norm(x, o, self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            down = self.moe(h, kernels)
        else:
            act = kernels.linear_silu_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
            down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        return x, down.mul_(self.residual_scale)


def _layer(arch: GraniteMoeHybridArchConfig, dtype: torch.dtype, device=None, tp=None,
           layer_idx: int = 0) -> nn.Module:
    if layer_idx in arch.mamba_layers:
        return GraniteMoeHybridMambaLayer(arch, dtype, device)
    return GraniteMoeHybridAttentionLayer(arch, dtype, device, tp, layer_idx)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """The Llama module (embedding, final norm, LM head) over Granite 4.0-H's layers, with
    Granite's embedding multiplier and logits divisor. `allocate_state` gives the Mamba2 layers
    their state slots before the first step."""

    decoder_layer = staticmethod(_layer)
    state_attr = "mamba"

    def __init__(self, arch: GraniteMoeHybridArchConfig, dtype: torch.dtype, device=None, *args, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise ValueError("Granite 4.0-H runs on the CPU only for now (its Mamba2 layers have no GPU path yet)")
        super().__init__(arch, dtype, device, *args, **kwargs)
        self.embed_scale, self.logits_scaling = arch.embedding_multiplier, arch.logits_scaling


def _float(value) -> float:
    """A config float; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class GraniteMoeHybridFamily(GraniteFamily):
    name = "Granite 4.0-H (Mamba2)"
    # one rank, float weights, no adapters, layer by layer; no speculative decoding and no KV
    # transfer (a state cannot be rolled back or sent yet: the engine refuses them)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, quantized=False,
                        decode_step=False)
    config_class = GraniteMoeHybridArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
        if len(types) != n or any(t not in _MAMBA_TYPES + _ATTENTION_TYPES for t in types):
            raise ValueError(f"layer_types must list 'mamba' or 'attention' for each of {n} layers")
        if cfg.get("attention_bias"):
            raise ValueError("Granite 4.0-H with attention_bias is not supported yet")
        position = cfg.get("position_embedding_type") or "nope"
        if position not in ("nope", "rope"):
            raise ValueError(f"position_embedding_type {position!r} is not supported ('nope' or 'rope')")
        hidden, heads = cfg["hidden_size"], int(cfg.get("mamba_n_heads", 128))
        d_head = cfg.get("mamba_d_head", "auto")
        d_head = int(cfg.get("mamba_expand", 2) * hidden // heads if d_head == "auto" else d_head)
        limit = cfg.get("time_step_limit") or (0.0, math.inf)
        experts = int(cfg.get("num_local_experts") or 0)
        moe = {}
        if experts:
            moe = dict(num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                       moe_intermediate_size=int(cfg["intermediate_size"]),
                       shared_expert_intermediate_size=int(cfg["shared_intermediate_size"]))
        return {**super().hf_fields(cfg, architecture), **moe,
                # the shared MLP is the layers' dense MLP where there are no experts
                "intermediate_size": int(cfg.get("shared_intermediate_size", 1024)),
                "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                "mamba_layers": [i for i, t in enumerate(types) if t in _MAMBA_TYPES],
                "mamba_n_heads": heads, "mamba_d_head": d_head,
                "mamba_d_state": int(cfg.get("mamba_d_state", 256)),
                "mamba_n_groups": int(cfg.get("mamba_n_groups", 1)),
                "mamba_d_conv": int(cfg.get("mamba_d_conv", 4)),
                "mamba_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
                "mamba_proj_bias": bool(cfg.get("mamba_proj_bias", False)),
                "time_step_min": _float(limit[0]), "time_step_max": _float(limit[1]),
                "use_rope": position == "rope"}

    def hf_layer_names(self, i: int, arch: GraniteMoeHybridArchConfig) -> dict[str, list[str]]:
        """Layer i's tensors; the Mamba2 conv weight and constants are fuse_weights'."""
        p = f"model.layers.{i}."
        names = {"input_layernorm": [p + "input_layernorm.weight"],
                 "post_attention_layernorm": [p + "post_attention_layernorm.weight"]}
        if not arch.num_experts:  # the shared MLP alone: [gate; up] already fused
            names.update({"gate_up_proj": [p + "shared_mlp.input_linear.weight"],
                          "down_proj": [p + "shared_mlp.output_linear.weight"]})
        if i in arch.mamba_layers:
            m = p + "mamba."
            names.update({"mamba.in_proj": [m + "in_proj.weight"], "mamba.out_proj": [m + "out_proj.weight"],
                          "mamba.norm": [m + "norm.weight"]})
            if arch.mamba_conv_bias:
                names["mamba.conv_bias"] = [m + "conv1d.bias"]
            if arch.mamba_proj_bias:
                names.update({"mamba.in_bias": [m + "in_proj.bias"], "mamba.out_bias": [m + "out_proj.bias"]})
            return names
        a = p + "self_attn."
        names.update({"qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "o_proj.weight"]})
        return names

    def fuse_experts(self, get, arch: GraniteMoeHybridArchConfig, i: int) -> dict[str, torch.Tensor]:
        """The router and the experts, stacked as checkpoints keep them ([gate; up] per expert),
        and the shared MLP (transformers' own names for the stacked ones also read)."""
        p, q = f"model.layers.{i}.", f"layers.{i}.moe."

        def either(saved: str, renamed: str) -> torch.Tensor:
            try:
                return get(p + saved)
            except ValueError:
                return get(p + renamed)

        return {q + "router": either("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),
                q + "gate_up": either("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
                q + "down": either("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
                q + "shared_gate_up": get(p + "shared_mlp.input_linear.weight"),
                q + "shared_down": get(p + "shared_mlp.output_linear.weight")}

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: GraniteMoeHybridArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The shared names, plus each Mamba2 layer's conv weight as [channel, tap] and A_log,
        D and dt_bias in fp32."""
        out = super().fuse_weights(_join_llama_cpp_splits(hf, arch), arch, dtype)
        get, get32 = getter(hf, dtype), getter(hf, torch.float32)
        for i in arch.mamba_layers:
            m, q = f"model.layers.{i}.mamba.", f"layers.{i}.mamba."
            out[q + "conv_weight"] = get(m + "conv1d.weight").reshape(arch.mamba_conv_dim, -1).contiguous()
            for name in ("A_log", "D", "dt_bias"):
                out[q + name] = get32(m + name).contiguous()
        return out

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """llama.cpp's `granitehybrid`: the Mamba2 layers are those with `ssm_in` (their
        head_count_kv is 0); Mamba2's sizes in the `ssm.*` keys (time_step_rank: heads,
        inner_size: heads x head dims, group_count, state_size, conv_kernel); feed_forward_length
        is the experts' width; RoPE only where `rope.scaling.finetuned` says so (llama.cpp's
        rule: Bamba and attention-only files)."""
        n, heads = int(meta("block_count")), int(meta("ssm.time_step_rank"))
        mamba = [i for i in range(n) if f"blk.{i}.ssm_in.weight" in tensors]
        experts = int(meta("expert_count", 0) or 0)
        shared = int(meta("expert_shared_feed_forward_length", 0) or 0)
        fields = {**super().gguf_fields(meta, tensors, architecture),
                  "architecture": architecture, "qk_norm": False, "mamba_layers": mamba,
                  "mamba_n_heads": heads, "mamba_d_head": int(meta("ssm.inner_size")) // heads,
                  "mamba_d_state": int(meta("ssm.state_size")), "mamba_n_groups": int(meta("ssm.group_count")),
                  "mamba_d_conv": int(meta("ssm.conv_kernel")),
                  "mamba_conv_bias": any(f"blk.{i}.ssm_conv1d.bias" in tensors for i in mamba),
                  "mamba_proj_bias": any(f"blk.{i}.ssm_in.bias" in tensors for i in mamba),
                  "use_rope": bool(meta("rope.scaling.finetuned", False)),
                  "intermediate_size": shared if experts else int(meta("feed_forward_length"))}
        if experts:
            fields.update(num_experts=experts, num_experts_per_tok=int(meta("expert_used_count")),
                          moe_intermediate_size=int(meta("feed_forward_length")),
                          shared_expert_intermediate_size=shared, mlp_only_layers=[])
        return fields

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        m = "mamba."
        return {"ssm_in": m + "in_proj", "ssm_conv1d": m + "conv1d", "ssm_dt": m + "dt", "ssm_a": m + "A_log",
                "ssm_d": m + "D", "ssm_norm": m + "norm", "ssm_out": m + "out_proj",
                "ffn_gate_inp": "block_sparse_moe.router.layer",
                "ffn_gate_shexp": "shared_mlp.gate", "ffn_up_shexp": "shared_mlp.up",
                "ffn_down_shexp": "shared_mlp.output_linear",  # (with experts; without, ffn_*)
                "ffn_gate": "shared_mlp.gate", "ffn_up": "shared_mlp.up", "ffn_down": "shared_mlp.output_linear"}

    def gguf_tensor(self, name: str, w, arch: GraniteMoeHybridArchConfig):
        """Undo llama.cpp's Mamba2 conversion: `ssm_a` is -exp(A_log) and `ssm_d` D, both
        [heads, 1]; dt_bias is `ssm_dt.bias`; the gated norm is [groups, inner / groups]."""
        if name.endswith(".mamba.A_log"):
            return name, np.log(-w).reshape(-1)
        if name.endswith((".mamba.D", ".mamba.norm.weight")):
            return name, w.reshape(-1)
        if name.endswith(".mamba.dt.bias"):
            return name[:-len(".dt.bias")] + ".dt_bias", w
        return name, w

    def model_class(self, arch: LlamaArchConfig) -> type[HybridForCausalLM]:
        return GraniteMoeHybridForCausalLM


def _join_llama_cpp_splits(hf: dict[str, torch.Tensor], arch: GraniteMoeHybridArchConfig) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter split, joined back under HF's names: the shared MLP's gate and
    up (`shared_mlp.input_linear`), and the experts, which the GGUF reader hands over one per
    expert (`mlp.experts.N.*`), stacked as `block_sparse_moe.input_linear` ([gate; up] per
    expert) and `output_linear`."""
    hf = dict(hf)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        if p + "shared_mlp.gate.weight" in hf:
            hf[p + "shared_mlp.input_linear.weight"] = torch.cat([hf.pop(p + "shared_mlp.gate.weight"),
                                                                  hf.pop(p + "shared_mlp.up.weight")])
        e = p + "mlp.experts.{}.{}_proj.weight"
        if arch.num_experts and e.format(0, "gate") in hf:
            experts = range(arch.num_experts)
            hf[p + "block_sparse_moe.input_linear.weight"] = torch.stack(
                [torch.cat([hf.pop(e.format(x, "gate")), hf.pop(e.format(x, "up"))]) for x in experts])
            hf[p + "block_sparse_moe.output_linear.weight"] = torch.stack([hf.pop(e.format(x, "down")) for x in experts])
    return hf


FAMILY = GraniteMoeHybridFamily()
