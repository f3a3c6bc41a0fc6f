"""Gemma 3 (text): a Llama-shaped decoder with Gemma's differences, over the same flat batch
and paged KV cache as kvflow/model/llama.py.

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

from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention import AttentionMetadata
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.kv_layout import UNIT_KV_SCALES
from kvflow.model.llama import ROPE_CACHE_MAX, _weight, rope_inv_freq
from kvflow.model.packed_linear import PackedWeight

from kvflow.model.gemma3_weights import LAYER_NORMS as _LAYER_NORMS

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _norm_weight(n: int, device) -> nn.Parameter:
    return _weight(n, dtype=torch.float32, device=device)  # the fp32 multiplier 1 + weight


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device, sliding_window: int | None):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.scale = arch.query_pre_attn_scalar ** -0.5
        # an fp8 KV cache's (k_scale, v_scale): the checkpoint's (model/kv_scales.py) or 1.0
        self.kv_scales = UNIT_KV_SCALES
        # an fp8 KV cache's key scales as the multiplier of q and k after RoPE (model/key_scales.py)
        self.qk_scale: torch.Tensor | None = None
        self.sliding_window = sliding_window
        for name in _LAYER_NORMS:
            setattr(self, name, _norm_weight(h, device))
        self.q_norm, self.k_norm = _norm_weight(d, device), _norm_weight(d, device)
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        self.o_proj = _weight(h, self.q_size, dtype=dtype, device=device)
        self.gate_up_proj = _weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = _weight(h, arch.intermediate_size, dtype=dtype, device=device)
        self.packed: dict[str, PackedWeight | None] = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (x, this layer's normed MLP output, not yet added)."""
        t, d = x.shape[0], self.head_dim
        norm = kernels.add_rms_norm_fp32_weight
        h = norm(x, residual_delta, self.input_layernorm, self.eps)
        pk = self.packed
        qkv = kernels.linear(h, self.qkv_proj, pk.get("qkv_proj"))
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        # QK-norm per head, written back so that RoPE rotates the fused rows in place
        qkv[:, :q_end] = norm(qkv[:, :q_end].reshape(-1, d), None, self.q_norm, self.eps).view(t, -1)
        qkv[:, q_end:k_end] = norm(qkv[:, q_end:k_end].reshape(-1, d), None, self.k_norm, self.eps).view(t, -1)
        kernels.rope(qkv, self.num_heads + self.num_kv_heads, d, *rope)
        if self.qk_scale is not None:
            qkv[:, :k_end].mul_(self.qk_scale)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.kv_scales)
        attn = kernels.attention(q, k_cache, v_cache, meta, self.scale, self.num_kv_heads, k=k, v=v,
                                 kv_scales=self.kv_scales)
        o = kernels.linear(attn, self.o_proj, pk.get("o_proj"))
        o = norm(o, None, self.post_attention_layernorm, self.eps)
        h = norm(x, o, self.pre_feedforward_layernorm, self.eps)
        act = kernels.linear_gelu_tanh_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
        down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        return x, norm(down, None, self.post_feedforward_layernorm, self.eps)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3's text decoder over a flat, unpadded batch of tokens from many requests; the
    same interface as LlamaForCausalLM (no tensor parallelism yet)."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, tp=None, kernels: Kernels | None = None):
        super().__init__()
        if tp is not None:
            raise ValueError("Gemma 3 does not run tensor-parallel yet; use tensor_parallel_size=1")
        if arch.attn_logit_softcapping:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported yet")
        self.arch, self.dtype, self.tp = arch, dtype, None
        h = arch.hidden_size
        self.embed_tokens = _weight(arch.vocab_size, h, dtype=dtype, device=device)
        windows = arch.layer_windows()
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, dtype, device, w) for w in windows)
        self.norm = _norm_weight(h, device)
        self.lm_head = None if arch.tie_word_embeddings else _weight(arch.vocab_size, h, dtype=dtype, device=device)
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
            rope = local if layer.sliding_window is not None else ropes[None]
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
