"""Qwen3.5 (Qwen3_5ForCausalLM, and its mixture of experts Qwen3_5MoeForCausalLM; their
ConditionalGeneration folders load their text part) and Qwen3-Next (Qwen3NextForCausalLM): Gated
DeltaNet layers (kvflow/layers/gated_deltanet.py, a
fixed-size state per request) interleaved with gated full-attention layers, each followed by a
SwiGLU MLP (Qwen3-Next and Qwen3.5 MoE: a mixture of experts with a sigmoid-gated shared expert,
kvflow/layers/moe.py; Qwen3.5 MoE's router always renormalises its top k and every layer has
experts), pre-norm, as Hugging Face's Qwen3_5TextModel and Qwen3NextModel compute
them. Only the attention layers hold a KV cache; the
linear-attention layers hold a state slot per running request (the KV cache coordinator's
state group).

What differs from Llama: every RMSNorm but the Gated DeltaNet's own multiplies by 1 + weight in
fp32 (kvflow keeps that fp32 multiplier, as for Gemma 3); the attention layers' q projection
carries a second half, per head, whose sigmoid gates the heads' outputs before o_proj; QK-norm
per head; RoPE on the first partial_rotary_factor of each head's dims. The vision-language
folders' M-RoPE sections rotate text tokens exactly as plain RoPE (their three position ids are
equal), so the text part needs no sections. Qwen3-Next's checkpoints interleave the linear attention's
q|k|v|z and b|a projections per key head; they are regrouped at load into Qwen3.5's layout."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.attention import Attention
from kvflow.layers.gated_deltanet import GatedDeltaNet
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.parameter import weight
from kvflow.layers.rotary import partial_rope_
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kernels import Kernels
from kvflow.models.family import getter
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.llama import LlamaFamily
from kvflow.models.registry import Supports

_TEXT_PREFIX = "model.language_model."  # a ConditionalGeneration folder's text model
_NEXT = "Qwen3NextForCausalLM"
_MOE = "Qwen3_5MoeForCausalLM"


@dataclass
class Qwen3_5ArchConfig(LlamaArchConfig):
    linear_layers: list[int] = field(default_factory=list)  # Gated DeltaNet layers, not attention
    linear_conv_kernel_dim: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128

    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.linear_layers]

    @property
    def linear_conv_dim(self) -> int:
        """The conv channels: q | k | v of the linear attention."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def state_bytes_per_request(self, dtype_bytes: int) -> int:
        """Per linear-attention layer: the conv window (kernel - 1 inputs in the model dtype)
        and the recurrent state of every value head, in fp32 whatever the model dtype."""
        window = (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim * dtype_bytes
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return len(self.linear_layers) * (window + recurrent)

    def num_parameters(self) -> int:
        h, d, n_lin = self.hidden_size, self.head_dim, len(self.linear_layers)
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * (2 * q + 2 * kv) + q * h + 2 * d
        nv, value = self.linear_num_value_heads, self.linear_num_value_heads * self.linear_value_head_dim
        linear = (h * (self.linear_conv_dim + value + 2 * nv) + self.linear_conv_dim * self.linear_conv_kernel_dim
                  + 2 * nv + self.linear_value_head_dim + value * h)
        shared = self.shared_expert_intermediate_size
        moe = (self.num_experts * (h + 3 * h * self.moe_intermediate_size)
               + (3 * h * shared + h if shared else 0))
        mlps = sum(moe if self.is_moe_layer(i) else 3 * h * self.intermediate_size
                   for i in range(self.num_hidden_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (embed + h + self.num_hidden_layers * 2 * h + mlps
                + (self.num_hidden_layers - n_lin) * attention + n_lin * linear)


def _norm_weight(n: int, device) -> nn.Parameter:
    return weight(n, dtype=torch.float32, device=device)  # the fp32 multiplier 1 + weight


class _Qwen3_5Layer(nn.Module):
    """What both kinds of layer share: the two norms and the SwiGLU MLP (or the expert block).
    forward is LlamaDecoderLayer's: returns (x, the MLP output not yet added)."""

    def __init__(self, arch: Qwen3_5ArchConfig, dtype: torch.dtype, device, layer_idx: int):
        super().__init__()
        h = arch.hidden_size
        self.eps = arch.rms_norm_eps
        self.input_layernorm = _norm_weight(h, device)
        self.post_attention_layernorm = _norm_weight(h, device)
        self.moe = SparseMoeBlock(arch, dtype, device) if arch.is_moe_layer(layer_idx) else None
        dense = self.moe is None
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device) if dense else None
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device) if dense else None
        self.packed: dict = {}

    def mixer(self, h: torch.Tensor, rope: tuple, kv_cache, meta: AttentionMetadata,
              kernels: Kernels) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache, meta: AttentionMetadata, kernels: Kernels,
                lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, pk = kernels.add_rms_norm_fp32_weight, self.packed
        o = self.mixer(norm(x, residual_delta, self.input_layernorm, self.eps), rope, kv_cache, meta, kernels)
        h = norm(x, o, self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x, self.moe(h, kernels)
        act = kernels.linear_silu_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
        return x, kernels.linear(act, self.down_proj, pk.get("down_proj"))


class Qwen3_5AttentionLayer(_Qwen3_5Layer):
    """Gated full attention: q|k|v|gate in one projection, QK-norm, partial RoPE, the heads'
    outputs times sigmoid(gate)."""

    def __init__(self, arch: Qwen3_5ArchConfig, dtype: torch.dtype, device, layer_idx: int):
        super().__init__(arch, dtype, device, layer_idx)
        d = arch.head_dim
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, d, d ** -0.5)
        q_size, kv_size = self.attn.q_size, self.attn.kv_size
        self.qkv_size = q_size + 2 * kv_size
        self.qkv_gate_proj = weight(self.qkv_size + q_size, arch.hidden_size, dtype=dtype, device=device)
        self.o_proj = weight(arch.hidden_size, q_size, dtype=dtype, device=device)
        self.q_norm, self.k_norm = _norm_weight(d, device), _norm_weight(d, device)
        self.partial_rope = arch.rope_dim != d

    def mixer(self, h, rope, kv_cache, meta, kernels):
        a, pk = self.attn, self.packed
        t, d = h.shape[0], a.head_dim
        proj = kernels.linear(h, self.qkv_gate_proj, pk.get("qkv_gate_proj"))
        qkv, gate = proj[:, :self.qkv_size].contiguous(), proj[:, self.qkv_size:]
        norm = kernels.add_rms_norm_fp32_weight
        q_end, k_end = a.q_size, a.q_size + a.kv_size
        qkv[:, :q_end] = norm(qkv[:, :q_end].reshape(-1, d), None, self.q_norm, self.eps).view(t, -1)
        qkv[:, q_end:k_end] = norm(qkv[:, q_end:k_end].reshape(-1, d), None, self.k_norm, self.eps).view(t, -1)
        (partial_rope_ if self.partial_rope else kernels.rope)(qkv, a.num_heads + a.num_kv_heads, d, *rope)
        attn = a(qkv, kv_cache, meta, kernels) * torch.sigmoid(gate)
        return kernels.linear(attn, self.o_proj, pk.get("o_proj"))


class Qwen3_5LinearLayer(_Qwen3_5Layer):
    """A Gated DeltaNet layer."""

    def __init__(self, arch: Qwen3_5ArchConfig, dtype: torch.dtype, device, layer_idx: int):
        super().__init__(arch, dtype, device, layer_idx)
        self.gdn = GatedDeltaNet(arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads,
                                 arch.linear_key_head_dim, arch.linear_value_head_dim,
                                 arch.linear_conv_kernel_dim, arch.rms_norm_eps, dtype, device)

    def mixer(self, h, rope, kv_cache, meta, kernels):
        return self.gdn(h, meta, kernels, self.packed)


def _layer(arch: Qwen3_5ArchConfig, dtype: torch.dtype, device=None, tp=None, layer_idx: int = 0) -> nn.Module:
    if layer_idx in arch.linear_layers:
        return Qwen3_5LinearLayer(arch, dtype, device, layer_idx)
    return Qwen3_5AttentionLayer(arch, dtype, device, layer_idx)


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """The Llama module's embedding, RoPE tables (rope_dim wide) and LM head over Qwen3.5's
    layers, with its fp32 final norm multiplier; one rank, layer by layer. `allocate_state`
    gives the Gated DeltaNet layers their state slots before the first step."""

    decoder_layer = staticmethod(_layer)
    state_attr = "gdn"
    attention_projections = ("qkv_gate_proj", "o_proj")

    def __init__(self, arch: Qwen3_5ArchConfig, dtype: torch.dtype, device=None, *args, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise ValueError("Qwen3.5 runs on the CPU only for now (its Gated DeltaNet layers have no GPU path yet)")
        super().__init__(arch, dtype, device, *args, **kwargs)
        self.norm = _norm_weight(arch.hidden_size, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list, attn_metadata: AttentionMetadata | list[AttentionMetadata],
                hidden: torch.Tensor | None = None, lora=None) -> torch.Tensor:
        """LlamaForCausalLM.forward for one rank without adapters: final-normed hidden states."""
        x = F.embedding(input_ids, self.embed_tokens)
        pos = positions if isinstance(positions, np.ndarray) else positions.numpy()
        rope = (np.ascontiguousarray(pos, dtype=np.int64), self.rope_cos, self.rope_sin)
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        delta = None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x, delta = layer(x, delta, rope, kv_cache, meta, self.kernels)
        return self.kernels.add_rms_norm_fp32_weight(x, delta, self.norm, self.arch.rms_norm_eps)


class Qwen3_5Family(LlamaFamily):
    name = "Gated DeltaNet (Qwen3.5, Qwen3-Next)"
    # one rank, float weights, no adapters, layer by layer; no speculative decoding and no KV
    # transfer (a state cannot be rolled back or sent yet: the engine refuses them)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, quantized=False,
                        decode_step=False)
    config_class = Qwen3_5ArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        n = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval", 4)
        types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                           for i in range(n)]
        if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
            raise ValueError(f"layer_types must list 'linear_attention' or 'full_attention' for each of {n} layers")
        if cfg.get("attention_bias"):
            raise ValueError("Qwen3.5 with attention_bias is not supported yet")
        experts = {}
        if architecture in (_NEXT, _MOE):
            experts = dict(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                           moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                           shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                           decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                           mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []])
        if architecture == _MOE:  # experts in every layer, the top k always renormalised
            experts.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return {"qk_norm": True, "attention_bias": False, **experts,
                "linear_layers": [i for i, t in enumerate(types) if t == "linear_attention"],
                **{key: int(cfg[key]) for key in ("linear_conv_kernel_dim", "linear_num_key_heads",
                                                  "linear_num_value_heads", "linear_key_head_dim",
                                                  "linear_value_head_dim") if key in cfg}}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """llama.cpp's `qwen35`, `qwen35moe` and `qwen3next`: the linear-attention layers are those
        with `ssm_a` (llama.cpp derives the same from `full_attention_interval`); the Gated
        DeltaNet's sizes in the `ssm.*` keys (state_size: a key head's dims, group_count: key
        heads, time_step_rank: value heads, inner_size: all value dims)."""
        n, value_heads = int(meta("block_count")), int(meta("ssm.time_step_rank"))
        fields = {**super().gguf_fields(meta, tensors, architecture), "qk_norm": True,
                  "linear_layers": [i for i in range(n) if f"blk.{i}.ssm_a" in tensors],
                  "linear_conv_kernel_dim": int(meta("ssm.conv_kernel")),
                  "linear_key_head_dim": int(meta("ssm.state_size")),
                  "linear_num_key_heads": int(meta("ssm.group_count")),
                  "linear_num_value_heads": value_heads,
                  "linear_value_head_dim": int(meta("ssm.inner_size")) // value_heads}
        if architecture == _MOE:
            fields.update(norm_topk_prob=True, mlp_only_layers=[])
        return fields

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        g = "linear_attn."
        return {"post_attention_norm": "post_attention_layernorm", "attn_qkv": g + "in_proj_qkv",
                "attn_gate": g + "in_proj_z", "ssm_beta": g + "in_proj_b", "ssm_alpha": g + "in_proj_a",
                "ssm_ba": g + "in_proj_ba", "ssm_a": g + "A_log", "ssm_dt": g + "dt",
                "ssm_conv1d": g + "conv1d", "ssm_norm": g + "norm", "ssm_out": g + "out_proj"}

    def gguf_tensor(self, name: str, w: np.ndarray, arch: Qwen3_5ArchConfig) -> tuple[str, np.ndarray]:
        """Undo llama.cpp's converter: it stores the 1 + weight norms (all but the Gated
        DeltaNet's) with the 1 added, -exp(A_log) as `ssm_a`, dt_bias as `ssm_dt.bias`; for
        Qwen3.5 (not Qwen3-Next) it also reorders the value heads from grouped by key head
        ([k0's v0, k0's v1, k1's v0, ...]) to tiled ([k0's v0, k1's v0, k0's v1, ...]) in every
        tensor that has them."""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return name, w - np.float32(1.0)
        if ".linear_attn." not in name:
            return name, w
        if name.endswith(".A_log"):
            w = np.log(-w)
        elif name.endswith(".dt.bias"):
            name = name[:-len(".dt.bias")] + ".dt_bias"
        nk, nv = arch.linear_num_key_heads, arch.linear_num_value_heads
        if arch.architecture == _NEXT or nk == nv:
            return name, w
        dv, qk = arch.linear_value_head_dim, 2 * nk * arch.linear_key_head_dim
        untile = lambda x, axis, d: _untile_value_heads(x, axis, nk, nv // nk, d)  # noqa: E731
        if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            return name, np.concatenate([w[:qk], untile(w[qk:], 0, dv)])
        if name.endswith(".in_proj_z.weight"):
            return name, untile(w, 0, dv)
        if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
            return name, untile(w, 0, 1)
        if name.endswith(".out_proj.weight"):
            return name, untile(w, 1, dv)
        return name, w

    def hf_layer_names(self, i: int, arch: Qwen3_5ArchConfig) -> dict[str, list[str]]:
        """Layer i's tensors; the norms, q's gate rows and the conv weight are fuse_weights'."""
        p = f"model.layers.{i}."
        m = p + "mlp."
        names = {} if arch.is_moe_layer(i) else {"gate_up_proj": [m + "gate_proj.weight", m + "up_proj.weight"],
                                                 "down_proj": [m + "down_proj.weight"]}
        if i in arch.linear_layers:
            g = p + "linear_attn."
            names.update({"gdn.out_proj": [g + "out_proj.weight"], "gdn.norm": [g + "norm.weight"]})
            if arch.architecture != _NEXT:  # Qwen3-Next's: regrouped in fuse_weights
                names["gdn.in_proj"] = [g + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
        else:
            names["o_proj"] = [p + "self_attn.o_proj.weight"]
        return names

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: Qwen3_5ArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The text model's tensors (a vision-language folder's vision and MTP tensors
        dropped); the 1 + weight norms as fp32 multipliers; q_proj's per-head [q; gate] rows
        split into q (beside k and v) and the gate (after them); the conv weight as
        [channel, tap]; A_log and dt_bias in fp32."""
        hf = {("model." + k[len(_TEXT_PREFIX):] if k.startswith(_TEXT_PREFIX) else k): w for k, w in hf.items()}
        out = super().fuse_weights(hf, arch, dtype)
        get, get32 = getter(hf, dtype), getter(hf, torch.float32)

        def multiplier(name: str) -> torch.Tensor:
            return (1.0 + get32(name)).contiguous()

        out["norm"] = multiplier("model.norm.weight")
        d, heads = arch.head_dim, arch.num_attention_heads
        for i in range(arch.num_hidden_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            out[q + "input_layernorm"] = multiplier(p + "input_layernorm.weight")
            out[q + "post_attention_layernorm"] = multiplier(p + "post_attention_layernorm.weight")
            if i in arch.linear_layers:
                g = p + "linear_attn."
                out[q + "gdn.conv_weight"] = get(g + "conv1d.weight").reshape(arch.linear_conv_dim, -1).contiguous()
                out[q + "gdn.A_log"] = get32(g + "A_log").contiguous()
                out[q + "gdn.dt_bias"] = get32(g + "dt_bias").contiguous()
                if arch.architecture == _NEXT and g + "in_proj_qkvz.weight" in hf:
                    out[q + "gdn.in_proj"] = _regroup_qkvz_ba(get(g + "in_proj_qkvz.weight"),
                                                              get(g + "in_proj_ba.weight"), arch)
                elif arch.architecture == _NEXT:  # llama.cpp's file: q|k|v and z already regrouped
                    qkvz = torch.cat([get(g + "in_proj_qkv.weight"), get(g + "in_proj_z.weight")])
                    out[q + "gdn.in_proj"] = torch.cat([qkvz, _regroup_ba(get(g + "in_proj_ba.weight"), arch)])
                continue
            a = p + "self_attn."
            q_gate = get(a + "q_proj.weight").view(heads, 2, d, -1)  # per head: [q; gate]
            out[q + "qkv_gate_proj"] = torch.cat([q_gate[:, 0].reshape(heads * d, -1), get(a + "k_proj.weight"),
                                                  get(a + "v_proj.weight"), q_gate[:, 1].reshape(heads * d, -1)])
            out[q + "q_norm"] = multiplier(a + "q_norm.weight")
            out[q + "k_norm"] = multiplier(a + "k_norm.weight")
        return out

    def fuse_experts(self, get, arch: Qwen3_5ArchConfig, i: int) -> dict[str, torch.Tensor]:
        """Layer i's experts as Qwen3.5 MoE checkpoints may keep them, stacked
        (`experts.gate_up_proj` [experts, 2 * inter, hidden], `experts.down_proj`), or one tensor
        per expert (LlamaFamily's names)."""
        p = f"model.layers.{i}.mlp."
        try:
            gate_up, down = get(p + "experts.gate_up_proj"), get(p + "experts.down_proj")
        except ValueError:
            return super().fuse_experts(get, arch, i)
        s, q = p + "shared_expert.", f"layers.{i}.moe."
        return {q + "router": get(p + "gate.weight"), q + "gate_up": gate_up, q + "down": down,
                q + "shared_gate_up": torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")]),
                q + "shared_down": get(s + "down_proj.weight"), q + "shared_gate": get(p + "shared_expert_gate.weight")}

    def model_class(self, arch: LlamaArchConfig) -> type[HybridForCausalLM]:
        return Qwen3_5ForCausalLM


def _regroup_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, arch: Qwen3_5ArchConfig) -> torch.Tensor:
    """Qwen3-Next's projections, per key head [q; k; v; z] and [b; a] (v, z, b and a for the
    value heads that key head serves), as Qwen3.5's [q; k; v; z; b; a] over all heads."""
    nk, dk, dv = arch.linear_num_key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r = arch.linear_num_value_heads // nk
    per_head = qkvz.view(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    return torch.cat([*(x.reshape(-1, qkvz.shape[-1]) for x in per_head), _regroup_ba(ba, arch)]).contiguous()


def _regroup_ba(ba: torch.Tensor, arch: Qwen3_5ArchConfig) -> torch.Tensor:
    """Qwen3-Next's per key head [b; a] as [b; a] over all heads."""
    r = arch.linear_num_value_heads // arch.linear_num_key_heads
    b, a = ba.view(arch.linear_num_key_heads, 2 * r, -1).split([r, r], dim=1)
    return torch.cat([b.reshape(-1, ba.shape[-1]), a.reshape(-1, ba.shape[-1])])


def _untile_value_heads(w: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """llama.cpp's value heads in tiled order (r groups of nk heads of d) back to grouped by
    key head (nk groups of r), along `axis`."""
    shape = w.shape
    tiled = w.reshape(*shape[:axis], r, nk, d, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(tiled, axis, axis + 1)).reshape(shape)


FAMILY = Qwen3_5Family()
