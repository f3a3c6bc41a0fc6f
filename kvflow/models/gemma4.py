"""Gemma 4 (text; a Gemma4ForConditionalGeneration folder loads its text part), as Hugging
Face's Gemma4ForCausalLM computes it, over the same flat batch and paged KV cache as the other
families, with the shared attention layer (kvflow/layers/attention.py).

What differs from Gemma 3 (kvflow/models/gemma3.py, whose text-part renaming it reuses):
- RMSNorm times the weight itself (not 1 + w), in fp32; q, k and v are each normed per head
  (v without a weight), and attention is unscaled (q.k, no 1/sqrt(d));
- sliding and full layers (`layer_types`) differ in head size (`global_head_dim`, or the
  config's `per_layer_config`), may differ in kv heads (`num_global_key_value_heads`), and each
  kind has its own RoPE: the full layers' is "proportional" (only the first
  partial_rotary_factor of each half of a head turns, at frequencies over the whole head);
- `attention_k_eq_v`: the full layers have no v projection, v is k's projection (normed as v);
- per-layer embeddings (PLE): a second table [vocab, layers * P] plus a projection of the
  token embedding give each layer a P-wide input, gated by the layer's output
  (gelu(x W_gate) * input) W_proj, normed and added after the MLP; each layer then scales its
  output by a learned `layer_scalar`;
- KV shared across the last `num_kv_shared_layers`: those layers have no k/v projections and
  read the cache of the last earlier layer of their kind; they own no cache
  (`attention_layers()` lists the owners only, so the KV budget and the scheduler's KV cache
  groups count those), and with `use_double_wide_mlp` their MLP is twice as wide;
- `enable_moe_block`: beside the dense MLP, an expert block routed from the layer's residual
  (kvflow/layers/moe.py's, with Gemma 4's router and GeGLU experts); both outputs are normed and
  summed;
- final logit soft-capping (cap * tanh(logits / cap)).

Each cache-owning layer's KV cache has its own shape (kv heads, head dim): the sliding and the
full layers are different KV cache groups (kvflow/core/kv_cache/groups.py), each with tensors
of its shape (kvflow/model/kv_cache.py). Where a cache is wider than its layer (an int8 cache
takes the widest shape for every layer), the layer stores its heads zero-padded to that width
(zero dims add nothing to q.k, and v's padding is cut from the output) and its kv heads
repeated (each query head still reads its own kv head): exact, at the cost of the padding."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.kv_layout import cache_geometry
from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.attention import Attention
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.parameter import weight
from kvflow.layers.rotary import ROPE_CACHE_MAX
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention_pattern import FULL, SLIDING
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.packed_linear import PackedWeight
from kvflow.models.family import ModelFamily, getter
from kvflow.models.gemma3 import Gemma3ForCausalLM, _norm_weight, _text_part
from kvflow.models.registry import Supports

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
_PLE_NORM = "post_per_layer_input_norm"
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass
class Gemma4ArchConfig(LlamaArchConfig):
    """LlamaArchConfig's head_dim and num_key_value_heads are the KV cache's (the widest of the
    cache-owning layers); each layer's own are in the lists below."""

    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    # per layer type: rope_theta, partial_rotary_factor (proportional), factor
    rope_per_type: dict = field(default_factory=dict)
    per_layer_input_size: int = 0  # P of the per-layer embeddings (0: none)
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    double_wide_mlp: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        if not 0 <= self.num_kv_shared_layers < n:
            raise ValueError(f"num_kv_shared_layers ({self.num_kv_shared_layers}) must leave at "
                             f"least one of the {n} layers with its own KV cache")
        types = self.types()
        owners = set(types[:n - self.num_kv_shared_layers])
        if set(types) - owners:
            raise ValueError("every layer type that shares KV needs an earlier layer of its type with a cache")
        for i in self.attention_layers():
            if (self.num_key_value_heads % self.layer_kv_heads[i]
                    or self.num_attention_heads % self.layer_kv_heads[i]):
                raise ValueError(f"layer {i}'s {self.layer_kv_heads[i]} kv heads must divide "
                                 f"{self.num_attention_heads} heads and the cache's {self.num_key_value_heads}")

    def types(self) -> list[str]:
        return self.layer_types or [FULL] * self.num_hidden_layers

    def attention_layers(self) -> list[int]:
        """The layers that own a KV cache: all but the last num_kv_shared_layers."""
        return list(range(self.num_hidden_layers - self.num_kv_shared_layers))

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return [(self.layer_kv_heads[i], self.layer_head_dims[i]) for i in self.attention_layers()]

    def kv_source(self, i: int) -> int:
        """The layer whose KV cache layer i reads: its own, or for a KV-shared layer the last
        cache-owning layer of its type (transformers' choice)."""
        owners = self.num_hidden_layers - self.num_kv_shared_layers
        if i < owners:
            return i
        types = self.types()
        return max(j for j in range(owners) if types[j] == types[i])

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0

    def mlp_size(self, i: int) -> int:
        shared = i >= self.num_hidden_layers - self.num_kv_shared_layers
        return self.intermediate_size * (2 if self.double_wide_mlp and shared else 1)

    def num_parameters(self) -> int:
        h, heads, p, n = self.hidden_size, self.num_attention_heads, self.per_layer_input_size, self.num_hidden_layers
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if p:
            total += self.per_layer_vocab_size * n * p + h * n * p + p
        for i in range(n):
            d, kv = self.layer_head_dims[i], self.layer_kv_heads[i]
            total += 2 * heads * d * h + d + 4 * h  # q, o, q_norm, the four norms
            if i == self.kv_source(i):
                has_v = not (self.attention_k_eq_v and self.types()[i] == FULL)
                total += kv * d * h * (2 if has_v else 1) + d  # k (and v), k_norm
            total += 3 * h * self.mlp_size(i)  # the MLP (layer_scalar is a buffer in HF)
            if p:
                total += 2 * h * p + h
            if self.num_experts:
                e = self.num_experts
                total += e * h + h + e + e * 3 * h * self.moe_intermediate_size + 3 * h
        return total


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm over the last dim, in fp32, times `w` (fp32; None: no weight)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out if w is None else out * w).to(x.dtype)


class Gemma4MoeBlock(SparseMoeBlock):
    """The expert block with Gemma 4's router (the input normed without weight, times a learned
    scale and 1/sqrt(hidden); softmax over all experts, top k renormalised, then times each
    chosen expert's learned scale) and GeGLU (gelu-tanh) experts."""

    def __init__(self, arch: Gemma4ArchConfig, dtype: torch.dtype, device=None):
        super().__init__(arch, dtype, device)
        self.router_scale = weight(arch.hidden_size, dtype=dtype, device=device)
        self.per_expert_scale = weight(arch.num_experts, dtype=dtype, device=device)
        self.eps, self.root = arch.rms_norm_eps, arch.hidden_size ** -0.5

    def pack_weights(self, pack) -> None:
        self.packed_experts = [{"gate_up": pack(self.gate_up[e]), "down": pack(self.down[e])}
                               for e in range(self.num_experts)]
        self.packed = {"router": pack(self.router)}

    def route(self, h: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        x = _rms(h, None, self.eps) * self.router_scale * self.root
        logits = kernels.linear(x, self.router, self.packed.get("router"))
        weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[experts]
        return weights.to(h.dtype), experts

    def expert(self, e: int, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        pk = self.packed_experts[e]
        act = kernels.linear_gelu_tanh_mul(x, self.gate_up[e], pk.get("gate_up"))
        return kernels.linear(act, self.down[e], pk.get("down"))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, arch: Gemma4ArchConfig, i: int, dtype: torch.dtype, device):
        super().__init__()
        h, heads, p = arch.hidden_size, arch.num_attention_heads, arch.per_layer_input_size
        self.layer_type = arch.types()[i]
        self.head_dim, self.kv_heads = arch.layer_head_dims[i], arch.layer_kv_heads[i]
        self.source = arch.kv_source(i)
        self.owns_kv = self.source == i
        self.has_v = not (arch.attention_k_eq_v and self.layer_type == FULL)
        d, kv = self.head_dim, self.kv_heads
        # the layer's own shape (its cache's, unless the cache pads it), unscaled
        self.attn = Attention(heads, kv, d, 1.0, arch.layer_windows()[i])
        self.eps = arch.rms_norm_eps
        for name in _LAYER_NORMS:
            setattr(self, name, _norm_weight(h, device))
        self.q_norm = _norm_weight(d, device)
        kv_rows = kv * d * ((2 if self.has_v else 1) if self.owns_kv else 0)
        self.qkv_proj = weight(heads * d + kv_rows, h, dtype=dtype, device=device)
        self.k_norm = _norm_weight(d, device) if self.owns_kv else None
        self.o_proj = weight(h, heads * d, dtype=dtype, device=device)
        inter = arch.mlp_size(i)
        self.gate_up_proj = weight(2 * inter, h, dtype=dtype, device=device)
        self.down_proj = weight(h, inter, dtype=dtype, device=device)
        self.layer_scalar = weight(1, dtype=dtype, device=device)
        self.moe = Gemma4MoeBlock(arch, dtype, device) if arch.num_experts else None
        if self.moe is not None:
            for name in _MOE_NORMS:
                setattr(self, name, _norm_weight(h, device))
        self.ple = bool(p)
        if p:
            self.per_layer_input_gate = weight(p, h, dtype=dtype, device=device)
            self.per_layer_projection = weight(h, p, dtype=dtype, device=device)
            setattr(self, _PLE_NORM, _norm_weight(h, device))
        self.packed: dict[str, PackedWeight | None] = {}

    def projections(self) -> tuple[str, ...]:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") + (
            ("per_layer_input_gate", "per_layer_projection") if self.ple else ())

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels, shared: dict) -> torch.Tensor:
        """x [T, hidden] -> the layer's output. `shared`: layer type -> this step's (k, v) of
        its last cache-owning layer, which KV-shared layers attend with."""
        a, pk, eps = self.attn, self.packed, self.eps
        t, d, heads = x.shape[0], self.head_dim, a.num_heads
        h = _rms(x, self.input_layernorm, eps)
        qkv = kernels.linear(h, self.qkv_proj, pk.get("qkv_proj"))
        q_end, k_end = heads * d, heads * d + self.kv_heads * d
        qkv[:, :q_end] = _rms(qkv[:, :q_end].reshape(t, heads, d), self.q_norm, eps).view(t, -1)
        if self.owns_kv:
            k_raw = qkv[:, q_end:k_end].reshape(t, self.kv_heads, d)
            v = _rms(qkv[:, k_end:].reshape(t, self.kv_heads, d) if self.has_v else k_raw, None, eps)
            qkv[:, q_end:k_end] = _rms(k_raw, self.k_norm, eps).view(t, -1)
            kernels.rope(qkv, heads + self.kv_heads, d, *rope)
            k = self._to_cache(qkv[:, q_end:k_end].reshape(t, self.kv_heads, d), kv_cache)
            shared[self.layer_type] = k, self._to_cache(v, kv_cache)
        else:
            kernels.rope(qkv, heads, d, *rope)
        q = qkv[:, :q_end].reshape(t, heads, d)
        cache_d = cache_geometry(kv_cache[0])[2]
        if d != cache_d:
            q = F.pad(q, (0, cache_d - d))
        k, v = shared[self.layer_type]
        out = a.attend(q, k, v, kv_cache, meta, kernels, write=self.owns_kv)
        if d != cache_d:
            out = out.view(t, heads, cache_d)[..., :d].reshape(t, heads * d)
        o = _rms(kernels.linear(out, self.o_proj, pk.get("o_proj")), self.post_attention_layernorm, eps)
        x = x + o
        h = _rms(x, self.pre_feedforward_layernorm, eps)
        act = kernels.linear_gelu_tanh_mul(h, self.gate_up_proj, pk.get("gate_up_proj"))
        m = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        if self.moe is not None:  # routed from the residual before the MLP, beside it
            m = _rms(m, self.post_feedforward_layernorm_1, eps) + self._experts(x, kernels)
        x = x + _rms(m, self.post_feedforward_layernorm, eps)
        if self.ple:
            g = F.gelu(kernels.linear(x, self.per_layer_input_gate, pk.get("per_layer_input_gate")),
                       approximate="tanh") * per_layer_input
            g = kernels.linear(g, self.per_layer_projection, pk.get("per_layer_projection"))
            x = x + _rms(g, self.post_per_layer_input_norm, eps)
        return x * self.layer_scalar

    def _experts(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """The expert block: routed on the residual x, run on its own pre-norm, post-normed."""
        moe = self.moe
        weights, experts = moe.route(x, kernels)
        h = _rms(x, self.pre_feedforward_layernorm_2, self.eps)
        out = moe.dispatch(h, weights, experts, kernels)
        return _rms(out, self.post_feedforward_layernorm_2, self.eps)

    def _to_cache(self, kv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[T, kv_heads, d] -> the cache's [T, cache kv heads, cache head dim] (the same but
        where the cache is the widest layer's: an int8 one, or a test's one shape)."""
        _, cache_kv, cache_d = cache_geometry(kv_cache[0])
        if self.kv_heads != cache_kv:
            kv = kv.repeat_interleave(cache_kv // self.kv_heads, dim=1)
        if self.head_dim != cache_d:
            kv = F.pad(kv, (0, cache_d - self.head_dim))
        return kv.contiguous()



def _inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """A layer type's inverse frequencies over its whole head (transformers' default and
    proportional RoPE: the proportional one turns the first partial_rotary_factor of each
    half-head at frequencies taken over the whole head; the rest stay still)."""
    angles = int(rope["partial_rotary_factor"] * head_dim // 2)
    turning = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat((turning, torch.zeros(head_dim // 2 - angles))) / rope["factor"]


class Gemma4ForCausalLM(nn.Module):
    """Gemma 4's text decoder over a flat, unpadded batch of tokens from many requests; the
    same interface as LlamaForCausalLM (one rank: its Supports say so)."""

    compute_logits = Gemma3ForCausalLM.compute_logits  # soft-capped where the config says
    takes_key_scales = False  # an fp8 cache's key scales: not calibrated across shared layers

    def __init__(self, arch: Gemma4ArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, kernels: Kernels | None = None):
        super().__init__()
        self.arch, self.dtype, self.tp = arch, dtype, None
        h, n, p = arch.hidden_size, arch.num_hidden_layers, arch.per_layer_input_size
        self.embed_tokens = weight(arch.vocab_size, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(arch, i, dtype, device) for i in range(n))
        self.norm = _norm_weight(h, device)
        self.lm_head = None if arch.tie_word_embeddings else weight(arch.vocab_size, h, dtype=dtype, device=device)
        # HF multiplies by these scales rounded to the weights' dtype
        self.embed_scale = torch.tensor(math.sqrt(h)).to(dtype).item()
        if p:
            self.embed_tokens_per_layer = weight(arch.per_layer_vocab_size, n * p, dtype=dtype, device=device)
            self.per_layer_model_projection = weight(n * p, h, dtype=dtype, device=device)
            self.per_layer_projection_norm = _norm_weight(p, device)
            self.per_layer_embed_scale = torch.tensor(math.sqrt(p)).to(dtype).item()
        rope_device = None if device is None or torch.device(device).type == "meta" else device
        self._rope_device = rope_device
        n_pos = max_position or min(arch.max_position_embeddings, ROPE_CACHE_MAX)
        self.ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._build_ropes(n_pos)
        self.kernels = kernels if kernels is not None else select_kernels(dtype, device=rope_device)
        self.packed_lm_head: PackedWeight | None = None

    def _build_ropes(self, n_pos: int) -> None:
        """Each layer type's cos/sin [n_pos, its head dim] (fp32)."""
        arch, types = self.arch, self.arch.types()
        for kind, rope in arch.rope_per_type.items():
            d = arch.layer_head_dims[types.index(kind)]
            freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), _inv_freq(rope, d))
            emb = torch.cat((freqs, freqs), dim=-1)
            self.ropes[kind] = (emb.cos().to(self._rope_device), emb.sin().to(self._rope_device))

    def cover_positions(self, n_pos: int) -> None:
        """Make the cos/sin tables hold positions 0..n_pos-1 (see LlamaForCausalLM's)."""
        if n_pos > next(iter(self.ropes.values()))[0].shape[0]:
            self._build_ropes(n_pos)

    def pack_weights(self) -> bool:
        """Prepacked copies of the projections, the experts and the LM head."""
        pack = self.kernels.pack
        if self.embed_tokens.device.type != "cpu" or pack is None:
            return False
        for layer in self.layers:
            layer.packed = {name: pack(getattr(layer, name)) for name in layer.projections()}
            if layer.moe is not None:
                layer.moe.pack_weights(pack)
        self.packed_lm_head = pack(self.embed_tokens if self.lm_head is None else self.lm_head)
        return True

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: each token's own per-layer embedding plus the normed projection of its
        embedding, averaged as transformers does ((a + b) / sqrt(2))."""
        arch, t = self.arch, x.shape[0]
        shape = (t, arch.num_hidden_layers, arch.per_layer_input_size)
        own = F.embedding(input_ids, self.embed_tokens_per_layer) * self.per_layer_embed_scale
        proj = self.kernels.linear(x, self.per_layer_model_projection, None) * arch.hidden_size ** -0.5
        proj = _rms(proj.view(shape), self.per_layer_projection_norm, arch.rms_norm_eps)
        return (proj + own.view(shape)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None],
                attn_metadata: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]. A KV-shared layer reads the cache and the
        metadata of the layer it shares with (`kv_caches` may hold None for it)."""
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        ple = self._per_layer_inputs(input_ids, x) if self.arch.per_layer_input_size else None
        pos = np.ascontiguousarray(positions if isinstance(positions, np.ndarray) else positions.numpy(),
                                   dtype=np.int64)
        ropes = {kind: (pos, cos, sin) for kind, (cos, sin) in self.ropes.items()}
        metas = attn_metadata if isinstance(attn_metadata, list) else None
        shared: dict = {}
        for i, layer in enumerate(self.layers):
            src = layer.source
            meta = attn_metadata if metas is None else metas[src]
            x = layer(x, None if ple is None else ple[:, i], ropes[layer.layer_type], kv_caches[src],
                      meta, self.kernels, shared)
        return _rms(x, self.norm, self.arch.rms_norm_eps)


# -- the family: config fields and checkpoint names -----------------------------------------------
class Gemma4Family(ModelFamily):
    name = "Gemma 4"
    # one rank, float weights, no adapters, decode steps layer by layer
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False,
                        quantized=False, decode_step=False)
    config_class = Gemma4ArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        """Layer types, each layer's head size and kv heads, RoPE per type, PLE, shared KV, experts."""
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 4 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not supported (causal only)")
        if cfg.get("attention_bias"):
            raise ValueError("Gemma 4 with attention_bias is not supported yet")
        n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        types[-1] = FULL  # as transformers forces it
        d, kv = cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg.get("num_key_value_heads") or heads
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        per_layer = cfg.get("per_layer_config")
        if per_layer is None:  # transformers' defaults for the full layers
            full = {"head_dim": cfg.get("global_head_dim", 512)}
            if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            per_layer = {str(i): full for i, t in enumerate(types) if t == FULL}
        # keyed by the layer's index as a string, zero-padded to the widest (transformers
        # writes "04" beside "34")
        per_layer = {int(k): v for k, v in per_layer.items()}
        entries = [per_layer.get(i) or {} for i in range(n)]
        head_dims = [int(e.get("head_dim", d)) for e in entries]
        kv_heads = [int(e.get("num_key_value_heads", kv)) for e in entries]
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        owners = range(n - shared)
        rope = cfg.get("rope_parameters") or _DEFAULT_ROPE
        rope_per_type = {}
        for kind in set(types):
            r = rope.get(kind) or {}
            if r.get("rope_type", "default") not in ("default", "proportional"):
                raise ValueError(f"Gemma 4 {kind} rope_type {r.get('rope_type')!r} is not supported "
                                 "(default, proportional)")
            proportional = r.get("rope_type") == "proportional"
            rope_per_type[kind] = {"rope_theta": float(r.get("rope_theta", 10_000.0)),
                                   "partial_rotary_factor": float(r.get("partial_rotary_factor", 1.0))
                                   if proportional else 1.0,
                                   "factor": float(r.get("factor", 1.0)) if proportional else 1.0}
        for kind in rope_per_type:
            if len({head_dims[i] for i in range(n) if types[i] == kind}) != 1:
                raise ValueError(f"Gemma 4's {kind} layers must share one head_dim")
        moe = bool(cfg.get("enable_moe_block"))
        p = int(cfg.get("hidden_size_per_layer_input") or 0)
        return {"layer_types": types, "sliding_window": int(cfg.get("sliding_window") or 512),
                "head_dim": max(head_dims[i] for i in owners),
                "num_key_value_heads": max(kv_heads[i] for i in owners),
                "layer_head_dims": head_dims, "layer_kv_heads": kv_heads,
                "rope_per_type": rope_per_type, "rope_scaling": None,
                "rope_theta": rope_per_type[FULL]["rope_theta"],
                "rope_local_theta": rope_per_type.get(SLIDING, rope_per_type[FULL])["rope_theta"],
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "per_layer_input_size": p,
                "per_layer_vocab_size": int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if p else 0,
                "num_kv_shared_layers": shared, "attention_k_eq_v": k_eq_v,
                "double_wide_mlp": bool(cfg.get("use_double_wide_mlp", False)),
                "num_experts": int(cfg["num_experts"]) if moe else 0,
                "num_experts_per_tok": int(cfg["top_k_experts"]) if moe else 0,
                "moe_intermediate_size": int(cfg["moe_intermediate_size"]) if moe else 0,
                "norm_topk_prob": True, "qk_norm": False, "attention_bias": False}

    # llama.cpp's gemma4 files (convert_hf_to_gguf.py's Gemma4Model): the norms stored as they
    # are (no 1 + w), the router's scale and the experts' scales beside the router and the down
    # experts, the experts kept stacked, and a `rope_freqs` tensor that stills the unturned
    # dims of the full layers' proportional RoPE
    gguf_reads_rope_freqs = True
    gguf_global_names = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                         "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                         "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        return {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm", "post_ffw_norm_1": "post_feedforward_layernorm_1",
                "post_ffw_norm_2": "post_feedforward_layernorm_2", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                "post_norm": _PLE_NORM, "layer_output_scale": "layer_scalar",
                "ffn_gate_inp": "router.proj", "ffn_gate_inp.scale": "router.scale",
                "ffn_down_exps.scale": "router.per_expert_scale",
                "ffn_gate_up_exps": "experts.gate_up_proj", "ffn_down_exps": "experts.down_proj"}

    def gguf_tensor(self, name: str, w: np.ndarray, arch: LlamaArchConfig) -> tuple[str, np.ndarray]:
        """The converter named HF's suffix-less parameters (layer_scalar, the stacked experts)
        `.weight`; back to HF's names."""
        if name.endswith(("layer_scalar.weight", "experts.gate_up_proj.weight", "experts.down_proj.weight")):
            name = name.removesuffix(".weight")
        return name, w

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """Layer types from the bool per layer; the full layers' head size in key_length, the
        sliding ones' in key_length_swa; kv heads and MLP widths once or per layer; the full
        layers' partial rotation from `rope_freqs` (1 where a dim pair turns, 1e30 where it
        stays still); k = v where a full layer that owns its cache has no attn_v."""
        n = int(meta("block_count"))
        pattern = meta("attention.sliding_window_pattern")
        if not isinstance(pattern, (list, tuple)) or len(pattern) != n:
            raise ValueError("a gemma4 GGUF file needs attention.sliding_window_pattern, one bool per layer")
        types = [SLIDING if s else FULL for s in pattern]
        full_d = int(meta("attention.key_length"))
        dims = {FULL: full_d, SLIDING: int(meta("attention.key_length_swa", full_d))}
        if (int(meta("attention.value_length", full_d)), int(meta("attention.value_length_swa", dims[SLIDING]))) \
                != (full_d, dims[SLIDING]):
            raise ValueError("Gemma 4 needs value heads as wide as key heads")
        if int(meta("rope.dimension_count_swa", dims[SLIDING])) != dims[SLIDING] or \
                int(meta("rope.dimension_count", full_d)) != full_d:
            raise ValueError("Gemma 4 GGUF with partial RoPE other than rope_freqs' is not supported")
        kv = meta("attention.head_count_kv")
        kv_heads = [int(v) for v in kv] if isinstance(kv, (list, tuple)) else [int(kv)] * n
        head_dims = [dims[t] for t in types]
        shared = int(meta("attention.shared_kv_layers", 0))
        owners = range(n - shared)
        ffn = meta("feed_forward_length")
        ffn = [int(v) for v in ffn] if isinstance(ffn, (list, tuple)) else [int(ffn)] * n
        double = [ffn[0] * (2 if i >= n - shared else 1) for i in range(n)]
        if ffn != [ffn[0]] * n and ffn != double:
            raise ValueError(f"Gemma 4 GGUF feed_forward_length {ffn} is neither one width nor double-wide "
                             "on the KV-shared layers")
        rope_per_type = {SLIDING: {"rope_theta": float(meta("rope.freq_base_swa", 10_000.0)),
                                   "partial_rotary_factor": 1.0, "factor": 1.0},
                         FULL: {"rope_theta": float(meta("rope.freq_base", 1_000_000.0)),
                                "partial_rotary_factor": 1.0, "factor": 1.0}}
        if "rope_freqs.weight" in tensors:
            factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
            turning = int((factors == 1.0).sum())
            if factors.size != full_d // 2 or not (factors[:turning] == 1.0).all() or \
                    not (factors[turning:] >= 1e29).all():
                raise ValueError("Gemma 4 GGUF rope_freqs other than 1 (turning) then 1e30 (still) "
                                 "is not supported")
            rope_per_type[FULL]["partial_rotary_factor"] = 2 * turning / full_d
        p = int(meta("embedding_length_per_layer_input", 0) or 0)
        experts = int(meta("expert_count", 0) or 0)
        return {"layer_types": types, "sliding_window": int(meta("attention.sliding_window") or 512),
                "head_dim": max(head_dims[i] for i in owners),
                "num_key_value_heads": max(kv_heads[i] for i in owners),
                "layer_head_dims": head_dims, "layer_kv_heads": kv_heads,
                "rope_per_type": {t: rope_per_type[t] for t in set(types)}, "rope_scaling": None,
                "rope_theta": rope_per_type[FULL]["rope_theta"],
                "rope_local_theta": rope_per_type[SLIDING]["rope_theta"], "rotary_dim": 0,
                "intermediate_size": ffn[0], "double_wide_mlp": ffn != [ffn[0]] * n,
                "per_layer_input_size": p,
                "per_layer_vocab_size": int(tensors["per_layer_token_embd.weight"].shape[-1]) if p else 0,
                "num_kv_shared_layers": shared,
                "attention_k_eq_v": any(types[i] == FULL and f"blk.{i}.attn_v.weight" not in tensors for i in owners),
                "num_experts": experts, "num_experts_per_tok": int(meta("expert_used_count", 0)) if experts else 0,
                "moe_intermediate_size": int(meta("expert_feed_forward_length", 0)) if experts else 0,
                "norm_topk_prob": True, "qk_norm": False, "attention_bias": False}

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: Gemma4ArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The language model's tensors (vision and audio ones dropped) under kvflow's names:
        q|k|v rows fused (q alone in a KV-shared layer, q|k where v is k), gate|up fused, the
        norms in fp32."""
        hf = _text_part(hf)
        get, getf = getter(hf, dtype), getter(hf, torch.float32)
        out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": getf("model.norm.weight")}
        if not arch.tie_word_embeddings:
            out["lm_head"] = get("lm_head.weight")
        if arch.per_layer_input_size:
            out["embed_tokens_per_layer"] = get("model.embed_tokens_per_layer.weight")
            out["per_layer_model_projection"] = get("model.per_layer_model_projection.weight")
            out["per_layer_projection_norm"] = getf("model.per_layer_projection_norm.weight")
        for i, layer in enumerate(self._layer_shapes(arch)):
            p, q, a, m = f"model.layers.{i}.", f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            norms = _LAYER_NORMS + (_MOE_NORMS if arch.num_experts else ()) + (
                (_PLE_NORM,) if arch.per_layer_input_size else ())
            for name in norms:
                out[q + name] = getf(p + name + ".weight")
            out[q + "q_norm"] = getf(a + "q_norm.weight")
            out[q + "qkv_proj"] = torch.cat([get(a + f"{x}_proj.weight") for x in layer])
            if "k" in layer:
                out[q + "k_norm"] = getf(a + "k_norm.weight")
            out[q + "o_proj"] = get(a + "o_proj.weight")
            out[q + "gate_up_proj"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            out[q + "down_proj"] = get(m + "down_proj.weight")
            out[q + "layer_scalar"] = get(p + "layer_scalar").reshape(1)
            if arch.per_layer_input_size:
                out[q + "per_layer_input_gate"] = get(p + "per_layer_input_gate.weight")
                out[q + "per_layer_projection"] = get(p + "per_layer_projection.weight")
            if arch.num_experts:
                out.update({q + "moe.router": get(p + "router.proj.weight"),
                            q + "moe.router_scale": get(p + "router.scale"),
                            q + "moe.per_expert_scale": get(p + "router.per_expert_scale"),
                            q + "moe.gate_up": get(p + "experts.gate_up_proj"),
                            q + "moe.down": get(p + "experts.down_proj")})
        return {k: v.contiguous() for k, v in out.items()}

    @staticmethod
    def _layer_shapes(arch: Gemma4ArchConfig) -> list[str]:
        """Each layer's attention projections: "qkv", "qk" (v is k) or "q" (KV shared)."""
        types = arch.types()
        return ["q" if arch.kv_source(i) != i else "qk" if arch.attention_k_eq_v and types[i] == FULL else "qkv"
                for i in range(arch.num_hidden_layers)]

    def model_class(self, arch: LlamaArchConfig) -> type[nn.Module]:
        return Gemma4ForCausalLM


FAMILY = Gemma4Family()
