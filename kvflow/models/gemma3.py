"""Gemma 3 (text; a Gemma3ForConditionalGeneration folder loads its text part): a Llama-shaped
decoder with Gemma's differences, over the same flat batch and paged KV cache as
kvflow/models/llama.py, with the same attention layer (kvflow/layers/attention.py). Its config
fields, weight names and module.

What differs from Llama, each as Hugging Face's Gemma3ForCausalLM computes it: embeddings
scaled by sqrt(hidden) (in the model dtype); RMSNorm times (1 + weight) in fp32, rounded once
(kvflow keeps the fp32 multiplier 1 + weight, which is also what GGUF files store); four norms
per layer (before and after attention and the MLP); per-head RMSNorm of q and k before RoPE;
queries scaled by 1/sqrt(query_pre_attn_scalar); a GeGLU MLP (gelu-tanh); sliding-window
layers interleaved with global ones, each kind with its own RoPE base (the global one may be
scaled); and, where the config sets it, final logit soft-capping."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.attention import Attention
from kvflow.layers.parameter import weight
from kvflow.layers.rotary import ROPE_CACHE_MAX, rope_inv_freq
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention_pattern import FULL, SLIDING
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.packed_linear import PackedWeight
from kvflow.models.family import ModelFamily, getter
from kvflow.models.registry import Supports

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _norm_weight(n: int, device) -> nn.Parameter:
    return weight(n, dtype=torch.float32, device=device)  # the fp32 multiplier 1 + weight


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device, sliding_window: int | None):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, d,
                              arch.query_pre_attn_scalar ** -0.5, sliding_window)
        q_size, kv_size = self.attn.q_size, self.attn.kv_size
        self.eps = arch.rms_norm_eps
        for name in _LAYER_NORMS:
            setattr(self, name, _norm_weight(h, device))
        self.q_norm, self.k_norm = _norm_weight(d, device), _norm_weight(d, device)
        self.qkv_proj = weight(q_size + 2 * kv_size, h, dtype=dtype, device=device)
        self.o_proj = weight(h, q_size, dtype=dtype, device=device)
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device)
        self.packed: dict[str, PackedWeight | None] = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (x, this layer's normed MLP output, not yet added)."""
        a = self.attn
        t, d = x.shape[0], a.head_dim
        norm = kernels.add_rms_norm_fp32_weight
        h = norm(x, residual_delta, self.input_layernorm, self.eps)
        pk = self.packed
        qkv = kernels.linear(h, self.qkv_proj, pk.get("qkv_proj"))
        q_end, k_end = a.q_size, a.q_size + a.kv_size
        # QK-norm per head, written back so that RoPE rotates the fused rows in place
        qkv[:, :q_end] = norm(qkv[:, :q_end].reshape(-1, d), None, self.q_norm, self.eps).view(t, -1)
        qkv[:, q_end:k_end] = norm(qkv[:, q_end:k_end].reshape(-1, d), None, self.k_norm, self.eps).view(t, -1)
        kernels.rope(qkv, a.num_heads + a.num_kv_heads, d, *rope)
        attn = a(qkv, kv_cache, meta, kernels)
        o = kernels.linear(attn, self.o_proj, pk.get("o_proj"))
        o = norm(o, None, self.post_attention_layernorm, self.eps)
        h = norm(x, o, self.pre_feedforward_layernorm, self.eps)
        act = kernels.linear_gelu_tanh_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
        down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        return x, norm(down, None, self.post_feedforward_layernorm, self.eps)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3's text decoder over a flat, unpadded batch of tokens from many requests; the
    same interface as LlamaForCausalLM (one rank: its Supports say so)."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, kernels: Kernels | None = None):
        super().__init__()
        if arch.attn_logit_softcapping:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported yet")
        self.arch, self.dtype, self.tp = arch, dtype, None
        h = arch.hidden_size
        self.embed_tokens = weight(arch.vocab_size, h, dtype=dtype, device=device)
        windows = arch.layer_windows()
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, dtype, device, w) for w in windows)
        self.norm = _norm_weight(h, device)
        self.lm_head = None if arch.tie_word_embeddings else weight(arch.vocab_size, h, dtype=dtype, device=device)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(math.sqrt(h)).to(dtype).item()
        rope_device = None if device is None or torch.device(device).type == "meta" else device
        n_pos = max_position or min(arch.max_position_embeddings, ROPE_CACHE_MAX)
        for name, table in self._rope_tables(n_pos).items():
            self.register_buffer(name, table.to(rope_device), persistent=False)
        self.kernels = kernels if kernels is not None else select_kernels(dtype, device=rope_device)
        self.packed_lm_head: PackedWeight | None = None

    def pack_weights(self) -> bool:
        """Prepacked copies of the projections and the LM head (the gate/up pair unfused: its
        activation is not the panel GEMM's SiLU)."""
        pack = self.kernels.pack
        if self.embed_tokens.device.type != "cpu" or pack is None:
            return False
        for layer in self.layers:
            layer.packed = {name: pack(getattr(layer, name)) for name in _PROJECTIONS}
        self.packed_lm_head = pack(self.embed_tokens if self.lm_head is None else self.lm_head)
        return True

    def _rope_tables(self, n_pos: int) -> dict[str, torch.Tensor]:
        """The global layers' cos/sin and the local (sliding-window) layers' own, [n_pos, head_dim]."""
        arch = self.arch
        local = replace(arch, rope_theta=arch.rope_local_theta or arch.rope_theta, rope_scaling=None)
        out = {}
        for prefix, a in (("rope", arch), ("rope_local", local)):
            freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), rope_inv_freq(a))
            emb = torch.cat((freqs, freqs), dim=-1)
            out[f"{prefix}_cos"], out[f"{prefix}_sin"] = emb.cos(), emb.sin()
        return out

    def cover_positions(self, n_pos: int) -> None:
        """Make the cos/sin tables hold positions 0..n_pos-1 (see LlamaForCausalLM's)."""
        if n_pos > self.rope_cos.shape[0]:
            device = self.rope_cos.device
            for name, table in self._rope_tables(n_pos).items():
                setattr(self, name, table.to(device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]; `attn_metadata` is one per layer (each
        layer's KV cache group's) or one for all."""
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        pos = np.ascontiguousarray(positions if isinstance(positions, np.ndarray) else positions.numpy(),
                                   dtype=np.int64)
        ropes = {None: (pos, self.rope_cos, self.rope_sin)}
        local = (pos, self.rope_local_cos, self.rope_local_sin)
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        delta, kernels = None, self.kernels
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            rope = local if layer.attn.sliding_window is not None else ropes[None]
            x, delta = layer(x, delta, rope, kv_cache, meta, kernels)
        return kernels.add_rms_norm_fp32_weight(x, delta, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """Logits [S, vocab] (fp32, or the model's dtype for an argmax), soft-capped where
        the config says (cap * tanh(logits / cap), in fp32)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.kernels.linear(hidden, weight, self.packed_lm_head)
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits.float().contiguous() if as_float else logits.contiguous()


# -- the family: config fields and checkpoint names -----------------------------------------------
class Gemma3Family(ModelFamily):
    name = "Gemma 3"
    # one rank, float weights, no adapters, decode steps layer by layer
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False,
                        quantized=False, decode_step=False)
    default_sliding_window = 512  # llama.cpp's, for files that leave the window out
    default_sliding_window_pattern = 6  # five local layers, then a global one
    gguf_norm_shift = 1.0  # llama.cpp stores the norms as 1 + w; back to HF's w, as transformers does
    hf_global_names = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        """The global and local RoPE, the query scale; its activation must be gelu-tanh."""
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get(FULL) or {}, rope.get(SLIDING) or {}
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        return {"rope_theta": float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
                "rope_scaling": ({k: v for k, v in full.items() if k != "rope_theta"} if full
                                 else cfg.get("rope_scaling")),
                "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
                "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
                "qk_norm": False, "attention_bias": False}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        # llama.cpp scales queries by 1/sqrt(head_dim) (hidden/heads for the 27B only)
        return {"rope_local_theta": float(meta("rope.freq_base_swa", 10_000.0)),
                "query_pre_attn_scalar": float(meta("attention.key_length", 256))}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        return {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

    def hf_layer_names(self, i: int, arch: LlamaArchConfig) -> dict[str, list[str]]:
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        return {"qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "o_proj.weight"],
                "gate_up_proj": [m + "gate_proj.weight", m + "up_proj.weight"],
                "down_proj": [m + "down_proj.weight"]}

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The language model's tensors (vision tensors dropped), its norms (four per layer,
        QK-norm) as fp32 multipliers 1 + weight, the factor HF's Gemma3RMSNorm multiplies by."""
        hf = _text_part(hf)
        out = super().fuse_weights(hf, arch, dtype)
        get = getter(hf, torch.float32)

        def multiplier(name: str) -> torch.Tensor:
            return (1.0 + get(name)).contiguous()

        out["norm"] = multiplier("model.norm.weight")
        for i in range(arch.num_hidden_layers):
            p = f"model.layers.{i}."
            for n in _LAYER_NORMS:
                out[f"layers.{i}.{n}"] = multiplier(p + n + ".weight")
            out[f"layers.{i}.q_norm"] = multiplier(p + "self_attn.q_norm.weight")
            out[f"layers.{i}.k_norm"] = multiplier(p + "self_attn.k_norm.weight")
        return out

    def model_class(self, arch: LlamaArchConfig) -> type[nn.Module]:
        return Gemma3ForCausalLM


def _text_part(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under Gemma3ForCausalLM's names."""
    out = {}
    for name, w in hf.items():
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        out[name.removeprefix("language_model.") if name.startswith("language_model.lm_head.") else name] = w
    return out


FAMILY = Gemma3Family()
