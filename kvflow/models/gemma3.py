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
scaled); and, where the config sets it, final logit soft-capping.

The module is the Llama one (kvflow/models/llama.py) over Gemma's layers, so tensor and
pipeline parallelism come from it: heads and MLP split, the O and down projections all-reduced
before Gemma's post-norms read them, the norms replicated, a vocab-parallel embedding and LM
head (soft-capping after the ranks' logits are gathered); a stage holds its layers only."""
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
from kvflow.layers.rotary import rope_inv_freq
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention_pattern import FULL, SLIDING
from kvflow.model.kernels import Kernels
from kvflow.model.packed_linear import PackedWeight
from kvflow.model.tp_layers import gather_vocab_logits, vocab_parallel_embedding
from kvflow.models.family import ModelFamily, getter
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import Supports

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _norm_weight(n: int, device) -> nn.Parameter:
    return weight(n, dtype=torch.float32, device=device)  # the fp32 multiplier 1 + weight


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 layer; under tensor parallelism `arch` holds this rank's shapes and `tp`
    all-reduces the O and down projections' partial sums before the post-norms read them."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__()
        self.tp = tp
        h, d = arch.hidden_size, arch.head_dim
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, d,
                              arch.query_pre_attn_scalar ** -0.5, arch.layer_windows()[layer_idx])
        q_size, kv_size = self.attn.q_size, self.attn.kv_size
        self.eps = arch.rms_norm_eps
        for name in _LAYER_NORMS:
            setattr(self, name, _norm_weight(h, device))
        self.q_norm, self.k_norm = _norm_weight(d, device), _norm_weight(d, device)
        self.qkv_proj = weight(q_size + 2 * kv_size, h, dtype=dtype, device=device)
        self.o_proj = weight(h, q_size, dtype=dtype, device=device)
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device)
        self.moe, self.qkv_bias, self.lora_slots = None, None, None
        self.packed: dict[str, PackedWeight | None] = {}

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
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
        if self.tp is not None:
            self.tp.all_reduce(o)  # the whole sum before the post-norm
        o = norm(o, None, self.post_attention_layernorm, self.eps)
        h = norm(x, o, self.pre_feedforward_layernorm, self.eps)
        act = kernels.linear_gelu_tanh_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
        down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        if self.tp is not None:
            self.tp.all_reduce(down)
        return x, norm(down, None, self.post_feedforward_layernorm, self.eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder over a flat, unpadded batch of tokens from many requests: the
    Llama module (a tensor-parallel rank's shard with the vocab-parallel embedding and LM head,
    a pipeline stage's layers) over Gemma's layers, with its scaled embeddings, fp32 final norm
    multiplier, local and global RoPE tables and soft-capped logits."""

    decoder_layer = Gemma3DecoderLayer

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, tp=None, kernels: Kernels | None = None,
                 layers: range | None = None):
        if arch.attn_logit_softcapping:
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported yet")
        super().__init__(arch, dtype, device, max_position, tp, kernels, layers)
        if self.pp_last:
            self.norm = _norm_weight(arch.hidden_size, device)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(math.sqrt(arch.hidden_size)).to(dtype).item()

    def pack_weights(self) -> bool:
        """Prepacked copies of the projections and the LM head (the gate/up pair unfused: its
        activation is not the panel GEMM's SiLU)."""
        pack = self.kernels.pack
        if self.layers[0].o_proj.device.type != "cpu" or pack is None:
            return False
        for layer in self.layers:
            layer.packed = {name: pack(getattr(layer, name)) for name in _PROJECTIONS}
        if self.pp_last:
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata | list[AttentionMetadata],
                hidden: torch.Tensor | None = None, lora=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward (a later pipeline stage takes the previous one's
        `hidden`; one other than the last returns its pair, not normed); no adapters.
        `inputs_embeds`: the step's embeddings where the caller made them (images placed)."""
        if hidden is not None:
            x, delta = hidden[0], hidden[1]
        else:
            x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            delta = None
        pos = np.ascontiguousarray(positions if isinstance(positions, np.ndarray) else positions.numpy(),
                                   dtype=np.int64)
        full = (pos, self.rope_cos, self.rope_sin)
        local = (pos, self.rope_local_cos, self.rope_local_sin)
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        kernels = self.kernels
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            rope = local if layer.attn.sliding_window is not None else full
            x, delta = layer(x, delta, rope, kv_cache, meta, kernels)
        if not self.pp_last:
            return torch.stack((x, delta))
        return kernels.add_rms_norm_fp32_weight(x, delta, self.norm, self.arch.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings times sqrt(hidden), [T, hidden]."""
        x = (F.embedding(input_ids, self.embed_tokens) if self.tp is None
             else vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp))
        return x * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor | None:
        """Logits [S, vocab] (fp32, or the model's dtype for an argmax), soft-capped where
        the config says (cap * tanh(logits / cap), in fp32) once the ranks' vocab slices are
        gathered (None on the ranks other than the driver)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.kernels.linear(hidden, weight, self.packed_lm_head)
        if self.tp is not None:
            logits = gather_vocab_logits(logits, self.arch.vocab_size, self.tp)
            if logits is None:
                return None
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits.float().contiguous() if as_float else logits.contiguous()


# -- the family: config fields and checkpoint names -----------------------------------------------
class Gemma3Family(ModelFamily):
    name = "Gemma 3"
    # float weights, no adapters, decode steps layer by layer
    supports = Supports(tensor_parallel=True, pipeline_parallel=True, lora=False,
                        quantized=False, decode_step=False)
    default_sliding_window = 512  # llama.cpp's, for files that leave the window out
    default_sliding_window_pattern = 6  # five local layers, then a global one
    gguf_norm_shift = 1.0  # llama.cpp stores the norms as 1 + w; back to HF's w, as transformers does
    hf_global_names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                       "lm_head": "lm_head.weight"}

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

    def hf_norm_names(self, i: int, arch: LlamaArchConfig) -> dict[str, str]:
        """The four norms of each layer and QK-norm (every Gemma 3 has it)."""
        p = f"model.layers.{i}."
        return {**{n: p + n + ".weight" for n in _LAYER_NORMS},
                "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}

    def norm_weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 multiplier 1 + w, the factor HF's Gemma3RMSNorm multiplies by."""
        return (1.0 + w.float()).contiguous()

    def hf_name(self, stored: str) -> str:
        return _text_name(stored)

    def hf_layer_names(self, i: int, arch: LlamaArchConfig) -> dict[str, list[str]]:
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        return {"qkv_proj": [a + f"{x}_proj.weight" for x in "qkv"], "o_proj": [a + "o_proj.weight"],
                "gate_up_proj": [m + "gate_proj.weight", m + "up_proj.weight"],
                "down_proj": [m + "down_proj.weight"]}

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The language model's tensors (vision tensors dropped), its norms (four per layer,
        QK-norm) as fp32 multipliers 1 + weight (norm_weight), from the weights as read (fp32
        from a GGUF file)."""
        hf = _text_part(hf)
        out = super().fuse_weights(hf, arch, dtype)
        get = getter(hf, torch.float32)
        out["norm"] = self.norm_weight(get(self.hf_global_names["norm"]), dtype)
        for i in range(arch.num_hidden_layers):
            for name, hf_name in self.hf_norm_names(i, arch).items():
                out[f"layers.{i}.{name}"] = self.norm_weight(get(hf_name), dtype)
        return out

    def model_class(self, arch: LlamaArchConfig) -> type[nn.Module]:
        return Gemma3ForCausalLM


def _text_name(name: str) -> str:
    """A Gemma3ForConditionalGeneration tensor's name under Gemma3ForCausalLM's (the text part's)."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = "model." + name[len(prefix):]
    return name.removeprefix("language_model.") if name.startswith("language_model.lm_head.") else name


def _text_part(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under Gemma3ForCausalLM's names."""
    return {_text_name(name): w for name, w in hf.items()}


FAMILY = Gemma3Family()
