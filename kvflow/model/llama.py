"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) and its close relatives (Qwen3's
QK-norm, Phi-3's LongRoPE and partial rotary, mixture-of-experts layers from kvflow/model/moe.py
for Qwen3-MoE, Mixtral and Qwen2-MoE): one flat batch of tokens, paged KV.

Weights are fused at load time (q|k|v rows into `qkv_proj`, gate|up into `gate_up_proj`) so
each layer runs four matmuls, on the CPU through prepacked copies (kvflow/model/packed_linear.py:
kvflow's bf16 panel GEMM on CPUs with AVX512-BF16, oneDNN for fp32). Every operation goes
through the model's `kernels` (kvflow/model/kernels.py), chosen once when the model is built.
Numerics follow Hugging Face's LlamaModel (RMSNorm in fp32, rotate_half RoPE with cos/sin
computed in fp32).

With `tp` (a tensor-parallel group, kvflow/distributed/parallel.py) the model is one rank's
shard: its own heads and MLP slice, all-reduced after the row-parallel O and down projections,
and a vocab-parallel embedding and LM head (kvflow/model/sharding.py has the layout)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.model.arch import LlamaArchConfig
from kvflow.attention.metadata import AttentionMetadata
from kvflow.model.decode_graph import DecodeGraph
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.attention.kv_layout import UNIT_KV_SCALES
from kvflow.model.moe import SparseMoeBlock
from kvflow.model.packed_linear import PackedWeight
from kvflow.model.sharding import local_arch
from kvflow.model.tp_layers import gather_vocab_logits, vocab_parallel_embedding

ROPE_CACHE_MAX = 32768  # positions precomputed by default; pass max_position for longer contexts


def rope_inv_freq(arch: LlamaArchConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 or linear scaling (same formulas as transformers);
    LongRoPE's are per position (rope_tables)."""
    dim = arch.rope_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] == "longrope":
        return inv_freq
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, smooth blend in between
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(arch: LlamaArchConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n_pos, rope_dim] in fp32. LongRoPE (Phi-3) divides the frequencies by its
    short factors up to the original context length and by its long factors beyond, and scales
    cos and sin by its attention factor, as transformers does. (transformers switches a whole
    sequence to the long factors once it outgrows the original length; here the choice is per
    position, so the keys already in the cache stay valid.)"""
    pos = torch.arange(n_pos, dtype=torch.float32)
    inv_freq = rope_inv_freq(arch)
    rs = arch.rope_scaling
    if rs is not None and rs["rope_type"] == "longrope":
        short = torch.tensor(rs["short_factor"], dtype=torch.float32)
        long = torch.tensor(rs["long_factor"], dtype=torch.float32)
        is_long = (pos >= rs["original_max_position_embeddings"]).unsqueeze(1)
        freqs = torch.where(is_long, torch.outer(pos, inv_freq / long), torch.outer(pos, inv_freq / short))
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(rs["attention_factor"])
        return emb.cos() * scale, emb.sin() * scale
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def partial_rope_(qkv: torch.Tensor, n_heads: int, head_dim: int,
                  positions: np.ndarray | torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on the first cos.shape[1] dims of each of the first n_heads heads, in place (the
    rest of each head passes through): Phi-3's partial_rotary_factor. Positions on a GPU come
    as a device tensor."""
    rot = cos.shape[1]
    x = qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)[..., :rot]
    idx = positions if isinstance(positions, torch.Tensor) else torch.from_numpy(positions)
    c, s = cos[idx].to(qkv.dtype).unsqueeze(1), sin[idx].to(qkv.dtype).unsqueeze(1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * c + rotated * s)


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer; under tensor parallelism `arch` holds this rank's shapes (local heads,
    MLP slice) and `tp` all-reduces the row-parallel outputs."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__()
        self.tp = tp
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.scale = d ** -0.5
        # what each sublayer's output is multiplied by before it joins the residual stream
        # (1: Llama; a family's multiplier, as Granite's residual_multiplier)
        self.residual_scale = 1.0
        # an fp8 KV cache's (k_scale, v_scale): the checkpoint's (model/kv_scales.py) or 1.0
        self.kv_scales = UNIT_KV_SCALES
        # an fp8 KV cache's key scales as the multiplier of q and k after RoPE (model/key_scales.py)
        self.qk_scale: torch.Tensor | None = None
        self.input_layernorm = _weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = _weight(h, dtype=dtype, device=device)
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        self.qkv_bias = (_weight(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if arch.attention_bias else None)
        self.o_proj = _weight(h, self.q_size, dtype=dtype, device=device)
        # Qwen3's QK-norm: one RMSNorm weight over head_dim, shared by the heads
        self.q_norm = _weight(d, dtype=dtype, device=device) if arch.qk_norm else None
        self.k_norm = _weight(d, dtype=dtype, device=device) if arch.qk_norm else None
        self.partial_rope = arch.rope_dim != d
        # a mixture-of-experts layer has the expert block instead of the dense MLP
        self.moe = SparseMoeBlock(arch, dtype, device) if arch.is_moe_layer(layer_idx) else None
        dense = self.moe is None
        self.gate_up_proj = _weight(2 * arch.intermediate_size, h, dtype=dtype, device=device) if dense else None
        self.down_proj = _weight(h, arch.intermediate_size, dtype=dtype, device=device) if dense else None
        self.packed: dict[str, PackedWeight | None] = {}  # prepacked projections (pack_weights)
        # adapters' slots per projection (model/lora.py's LoRASlots), with enable_lora
        self.lora_slots: dict | None = None

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None, rope: tuple,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kernels: Kernels, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the residual stream, `residual_delta` the previous layer's MLP output, not yet
        added (the add is fused into this layer's first norm). Returns (x, this MLP's output).
        `lora` (model/lora.py's LoRAStep): the step's adapter rows, added to each projection's
        output (the norms then run apart from the projections, which need their input)."""
        t = x.shape[0]
        pk = self.packed
        slots = self.lora_slots if lora is not None else None
        if slots is None:
            qkv = kernels.norm_linear(x, residual_delta, self.input_layernorm, self.eps,
                                      self.qkv_proj, pk.get("qkv_proj"), self.qkv_bias)
        else:
            h = kernels.add_rms_norm(x, residual_delta, self.input_layernorm, self.eps)
            qkv = kernels.linear(h, self.qkv_proj, pk.get("qkv_proj"), self.qkv_bias)
            kernels.lora(qkv, h, slots["qkv"], lora)
        if self.q_norm is not None:
            self._qk_norm(qkv, kernels)
        # RoPE on the q and k heads together, in place in the fused projection's output
        rope_ = partial_rope_ if self.partial_rope else kernels.rope
        rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
        if self.qk_scale is not None:
            qkv[:, :self.q_size + self.kv_size].mul_(self.qk_scale)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.kv_scales)
        attn = kernels.attention(q, k_cache, v_cache, meta, self.scale, self.num_kv_heads, k=k, v=v,
                                 kv_scales=self.kv_scales)
        o = kernels.linear(attn, self.o_proj, pk.get("o_proj"))
        if slots is not None:
            kernels.lora(o, attn, slots["o"], lora)
        if self.tp is not None:
            self.tp.all_reduce(o)  # row-parallel: each rank holds a partial sum
        o = self._scaled(o)
        if self.moe is not None:  # under tensor parallelism each rank holds a slice of every expert
            down = self.moe(kernels.add_rms_norm(x, o, self.post_attention_layernorm, self.eps), kernels)
            if self.tp is not None:
                self.tp.all_reduce(down)
            return x, self._scaled(down)
        if slots is None:
            act = kernels.norm_linear_silu_mul(x, o, self.post_attention_layernorm, self.eps,
                                               self.gate_up_proj, pk.get("gate_up_proj"))
        else:
            h = kernels.add_rms_norm(x, o, self.post_attention_layernorm, self.eps)
            gate_up = kernels.linear(h, self.gate_up_proj, pk.get("gate_up_proj"))
            kernels.lora(gate_up, h, slots["gate_up"], lora)
            act = kernels.silu_mul(gate_up)
        down = kernels.linear(act, self.down_proj, pk.get("down_proj"))
        if slots is not None:
            kernels.lora(down, act, slots["down"], lora)
        if self.tp is not None:
            self.tp.all_reduce(down)
        return x, self._scaled(down)

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out.mul_(self.residual_scale) if self.residual_scale != 1.0 else out

    def _qk_norm(self, qkv: torch.Tensor, kernels: Kernels) -> None:
        """RMSNorm over each q and k head of the fused projection's output, in place."""
        t, q, kv, d = qkv.shape[0], self.q_size, self.kv_size, self.head_dim
        for start, size, weight in ((0, q, self.q_norm), (q, kv, self.k_norm)):
            heads = qkv[:, start:start + size].reshape(-1, d)  # a copy: the slice is strided
            qkv[:, start:start + size] = kernels.add_rms_norm(heads, None, weight, self.eps).view(t, size)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a flat, unpadded batch of tokens from many requests.

    `arch` is always the whole model's; with `tp` (a tensor-parallel group) this module holds
    rank `tp.rank`'s shard of it (shapes from sharding.local_arch). `kernels`: what serves each
    operation (default: chosen here for `dtype` on the CPU, or on `device`)."""

    # a family whose layers differ (OLMo 2's post-norms) gives its own, with this one's
    # attributes and forward signature
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, tp=None, kernels: Kernels | None = None,
                 layers: range | None = None):
        super().__init__()
        self.arch, self.dtype, self.tp = arch, dtype, tp
        shard = arch if tp is None else local_arch(arch, tp.world_size)
        h = arch.hidden_size
        # a pipeline stage holds `layers` (global indices) only: the embedding on the first
        # stage, the final norm and the LM head on the last (a tied head: the embedding there)
        layers = range(arch.num_hidden_layers) if layers is None else layers
        self.pp_first, self.pp_last = layers.start == 0, layers.stop == arch.num_hidden_layers
        needs_embedding = self.pp_first or (self.pp_last and arch.tie_word_embeddings)
        self.embed_tokens = (_weight(shard.vocab_size, h, dtype=dtype, device=device)
                             if needs_embedding else None)
        self.layers = nn.ModuleList(self.decoder_layer(shard, dtype, device, tp, layer_idx=i)
                                    for i in layers)
        self.norm = _weight(h, dtype=dtype, device=device) if self.pp_last else None
        # tied models read the embedding matrix directly (no second parameter to keep in sync)
        self.lm_head = (None if arch.tie_word_embeddings or not self.pp_last
                        else _weight(shard.vocab_size, h, dtype=dtype, device=device))
        # cos/sin in fp32 like HF; on the CPU even when the weights start on the meta device
        rope_device = None if device is None or torch.device(device).type == "meta" else device
        n_pos = max_position or min(arch.max_position_embeddings, ROPE_CACHE_MAX)
        cos, sin = rope_tables(arch, n_pos)
        self.register_buffer("rope_cos", cos.to(rope_device), persistent=False)
        self.register_buffer("rope_sin", sin.to(rope_device), persistent=False)
        self.kernels = kernels if kernels is not None else select_kernels(dtype, device=rope_device)
        self.packed_lm_head: PackedWeight | None = None
        # a family's multiplier of the embeddings and divisor of the logits (Granite's)
        self.embed_scale, self.logits_scaling = 1.0, 1.0
        # a quantized model's embedding: token ids -> rows in `dtype` (kvflow/model/quant)
        self.quantized_embedding = None
        # decode steps' layers in one C call (decode_graph.py): built on the first step, for
        # the kernels of that moment (None: this model's steps run layer by layer)
        self._decode_graph: tuple = (None, None)

    def pack_weights(self) -> bool:
        """Keep prepacked copies of the projections and the LM head beside the weights
        (which stay as they are for state_dict and the embedding). False: not usable here."""
        pack = self.kernels.pack
        if self.layers[0].o_proj.device.type != "cpu" or pack is None:
            return False
        for layer in self.layers:
            layer.packed = {name: pack(getattr(layer, name), gate_up=name == "gate_up_proj")
                            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                            if getattr(layer, name) is not None}
            if layer.moe is not None:
                layer.moe.pack_weights(pack)
        if self.pp_last:
            self.packed_lm_head = pack(self.embed_tokens if self.lm_head is None else self.lm_head)
        return True

    def cover_positions(self, n_pos: int) -> None:
        """Make the cos/sin tables hold positions 0..n_pos-1 (the kernels index them without a
        bound check): the runner calls this with the longest sequence the engine admits."""
        if n_pos > self.rope_cos.shape[0]:
            cos, sin = rope_tables(self.arch, n_pos)
            self.rope_cos = cos.to(self.rope_cos.device)
            self.rope_sin = sin.to(self.rope_sin.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata | list[AttentionMetadata],
                hidden: torch.Tensor | None = None, lora=None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for the flat batch; K/V land in `kv_caches`.
        `attn_metadata`: one for all layers, or one per layer (its KV cache group's, which
        carries a sliding window where the layer has one). A pipeline stage other than the
        first takes `hidden` = the previous stage's [2, T, hidden] (the residual stream and the
        last MLP output not yet added); one other than the last returns that pair, not normed.
        `lora`: the step's adapter rows (model/lora.py's LoRAStep; None: all rows are the base
        model's). A step with adapter rows runs layer by layer (the one-call decode step has no
        LoRA)."""
        if hidden is not None:
            x, delta = hidden[0], hidden[1]
        elif self.quantized_embedding is not None:
            x = self.quantized_embedding(input_ids)
        elif self.tp is None:
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            x = vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp)
        if hidden is None and self.embed_scale != 1.0:
            x = x * self.embed_scale
        first = attn_metadata[0] if isinstance(attn_metadata, list) else attn_metadata
        if first.device_positions is not None:  # on a GPU: no host copy in the step
            rope = (first.device_positions, self.rope_cos, self.rope_sin)
        else:
            pos = positions if isinstance(positions, np.ndarray) else positions.numpy()
            rope = (np.ascontiguousarray(pos, dtype=np.int64), self.rope_cos, self.rope_sin)
        kernels = self.kernels
        whole = self.pp_first and self.pp_last
        if (whole and lora is None and first.device_positions is None
                and first.num_decodes == first.num_tokens):
            delta = self._run_decode_graph(x, rope[0], kv_caches, attn_metadata)
            if delta is not None:
                return kernels.add_rms_norm(x, delta, self.norm, self.arch.rms_norm_eps)
        if hidden is None:
            delta = None
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x, delta = layer(x, delta, rope, kv_cache, meta, kernels, lora)
        if not self.pp_last:
            return torch.stack((x, delta))
        return kernels.add_rms_norm(x, delta, self.norm, self.arch.rms_norm_eps)

    def forget_decode_graph(self) -> None:
        """Build the one-call step again at the next decode: its layer records hold pointers
        to per-layer state (an fp8 cache's key scales) that changed."""
        self._decode_graph = (None, None)

    def _graph(self) -> DecodeGraph | None:
        kernels, graph = self._decode_graph
        if kernels is not self.kernels:
            graph = DecodeGraph.build(self)
            self._decode_graph = (self.kernels, graph)
        return graph

    def _run_decode_graph(self, x: torch.Tensor, positions: np.ndarray, kv_caches: list,
                          attn_metadata) -> torch.Tensor | None:
        """Every layer of a decode step in one C call where this model and step qualify: the
        last MLP output, not yet added to x; None: run the layers one by one."""
        graph = self._graph()
        return None if graph is None else graph.run(x, positions, kv_caches, attn_metadata)

    def decode_step_rows(self) -> int:
        """The most rows a decode-only step (or a speculative verification step) runs in one
        C call on this model; 0: its steps run layer by layer."""
        graph = self._graph()
        return 0 if graph is None else graph.max_rows

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor | None:
        """Logits [S, vocab] for the rows that sample, in fp32 (as_float=False: in the model's
        dtype, for an argmax). Under tensor parallelism every rank computes its vocab slice
        and only the driver gets the whole (None elsewhere)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.kernels.linear(hidden, weight, self.packed_lm_head)
        if self.tp is not None:
            logits = gather_vocab_logits(logits, self.arch.vocab_size, self.tp)
            if logits is None:
                return None
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float().contiguous() if as_float else logits.contiguous()
