"""The Llama family and its close relatives, one decoder: Llama 2/3, SmolLM, Mistral, Qwen2
(q/k/v biases), Qwen3 (QK-norm), Phi-3 (LongRoPE, partial rotary, q/k/v and gate/up fused in its
checkpoints) and the mixture-of-experts Qwen3-MoE, Mixtral and Qwen2-MoE (kvflow/layers/moe.py):
their module, config fields, HF and GGUF weight names, and what they support.

One flat batch of tokens from many requests, paged KV. Weights are fused at load time (q|k|v
rows into `qkv_proj`, gate|up into `gate_up_proj`) so each layer runs four matmuls, on the CPU
through prepacked copies (kvflow/model/packed_linear.py: kvflow's bf16 panel GEMM on CPUs with
AVX512-BF16, oneDNN for fp32). Every operation goes through the model's `kernels`
(kvflow/model/kernels.py), chosen once when the model is built. Numerics follow Hugging Face's
LlamaModel (RMSNorm in fp32, rotate_half RoPE with cos/sin computed in fp32).

With `tp` (a tensor-parallel group, kvflow/distributed/parallel.py) the model is one rank's
shard: its own heads and MLP slice, all-reduced after the row-parallel O and down projections,
and a vocab-parallel embedding and LM head (kvflow/model/sharding.py has the layout)."""
from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.attention import Attention
from kvflow.layers.moe import SparseMoeBlock
from kvflow.layers.parameter import weight
from kvflow.layers.rotary import ROPE_CACHE_MAX, partial_rope_, rope_tables
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.decode_graph import DecodeGraph
from kvflow.model.kernels import Kernels, select_kernels
from kvflow.model.packed_linear import PackedWeight, panel_rows_of, released, serves_alone, unpack_panels
from kvflow.model.sharding import local_arch
from kvflow.model.tp_layers import gather_vocab_logits, vocab_parallel_embedding
from kvflow.models.family import ModelFamily
from kvflow.models.registry import Supports

class LlamaDecoderLayer(nn.Module):
    """One decoder layer; under tensor parallelism `arch` holds this rank's shapes (local heads,
    MLP slice) and `tp` all-reduces the row-parallel outputs."""

    use_rope = True  # False: q and k attend unrotated (SmolLM3's NoPE layers)
    moe_block: type[nn.Module] = SparseMoeBlock  # a family's own expert block (gpt-oss's)

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None, tp=None,
                 layer_idx: int = 0):
        super().__init__()
        self.tp = tp
        h, d = arch.hidden_size, arch.head_dim
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, d, d ** -0.5,
                              arch.layer_windows()[layer_idx])
        q_size, kv_size = self.attn.q_size, self.attn.kv_size
        self.eps = arch.rms_norm_eps
        # what each sublayer's output is multiplied by before it joins the residual stream
        # (1: Llama; a family's multiplier, as Granite's residual_multiplier)
        self.residual_scale = 1.0
        self.input_layernorm = weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = weight(h, dtype=dtype, device=device)
        self.qkv_proj = weight(q_size + 2 * kv_size, h, dtype=dtype, device=device)
        self.qkv_bias = (weight(q_size + 2 * kv_size, dtype=dtype, device=device)
                         if arch.attention_bias else None)
        self.o_proj = weight(h, q_size, dtype=dtype, device=device)
        self.o_bias = None  # a family's output projection bias (gpt-oss's), added after the all-reduce
        # Qwen3's QK-norm: one RMSNorm weight over head_dim, shared by the heads
        self.q_norm = weight(d, dtype=dtype, device=device) if arch.qk_norm else None
        self.k_norm = weight(d, dtype=dtype, device=device) if arch.qk_norm else None
        self.partial_rope = arch.rope_dim != d
        # a mixture-of-experts layer has the expert block instead of the dense MLP
        self.moe = self.moe_block(arch, dtype, device) if arch.is_moe_layer(layer_idx) else None
        dense = self.moe is None
        self.gate_up_proj = weight(2 * arch.intermediate_size, h, dtype=dtype, device=device) if dense else None
        self.down_proj = weight(h, arch.intermediate_size, dtype=dtype, device=device) if dense else None
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
        a = self.attn
        if self.use_rope:
            rope_ = partial_rope_ if self.partial_rope else kernels.rope
            rope_(qkv, a.num_heads + a.num_kv_heads, a.head_dim, *rope)
        attn = a(qkv, kv_cache, meta, kernels)
        o = kernels.linear(attn, self.o_proj, pk.get("o_proj"))
        if slots is not None:
            kernels.lora(o, attn, slots["o"], lora)
        if self.tp is not None:
            self.tp.all_reduce(o)  # row-parallel: each rank holds a partial sum
        if self.o_bias is not None:
            o += self.o_bias
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
        t, q, kv, d = qkv.shape[0], self.attn.q_size, self.attn.kv_size, self.attn.head_dim
        for start, size, w in ((0, q, self.q_norm), (q, kv, self.k_norm)):
            heads = qkv[:, start:start + size].reshape(-1, d)  # a copy: the slice is strided
            qkv[:, start:start + size] = kernels.add_rms_norm(heads, None, w, self.eps).view(t, size)


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
        self.embed_tokens = (weight(shard.vocab_size, h, dtype=dtype, device=device)
                             if needs_embedding else None)
        self.layers = nn.ModuleList(self.decoder_layer(shard, dtype, device, tp, layer_idx=i)
                                    for i in layers)
        self.norm = weight(h, dtype=dtype, device=device) if self.pp_last else None
        # tied models read the embedding matrix directly (no second parameter to keep in sync)
        self.lm_head = (None if arch.tie_word_embeddings or not self.pp_last
                        else weight(shard.vocab_size, h, dtype=dtype, device=device))
        # cos/sin in fp32 like HF; on the CPU even when the weights start on the meta device
        rope_device = None if device is None or torch.device(device).type == "meta" else device
        n_pos = max_position or min(arch.max_position_embeddings, ROPE_CACHE_MAX)
        for name, table in self._rope_tables(n_pos).items():
            self.register_buffer(name, table.to(rope_device), persistent=False)
        self.kernels = kernels if kernels is not None else select_kernels(dtype, device=rope_device)
        self.packed_lm_head: PackedWeight | None = None
        # a family's multiplier of the embeddings and divisor of the logits (Granite's)
        self.embed_scale, self.logits_scaling = 1.0, 1.0
        # a quantized model's embedding: token ids -> rows in `dtype` (kvflow/model/quant)
        self.quantized_embedding = None
        # decode steps' layers in one C call (decode_graph.py): built on the first step, for
        # the kernels of that moment (None: this model's steps run layer by layer)
        self._decode_graph: tuple = (None, None)
        # state_dict names of weights released after packing -> their packs: state_dict()
        # still gives every weight, from its panels
        self._released: dict[str, PackedWeight] = {}
        self._register_state_dict_hook(partial(_unpacked_state, self._released))

    def pack_weights(self) -> bool:
        """Pack the projections and the LM head for their kernels; each float weight a pack
        serves alone goes (released: on the meta device), so a model holds one copy of its
        weights. A tied embedding then reads its rows from the LM head's panels. False: not
        usable here (the weights stay as they are)."""
        if self.layers[0].o_proj.device.type != "cpu" or self.kernels.pack is None:
            return False
        for i in range(len(self.layers)):
            self.pack_layer(i)
        self.pack_head()
        return True

    def packs_by_layer(self) -> bool:
        """pack_layer and pack_head are this model's pack_weights (a loader may then read and
        pack one layer at a time: model/loader.py); False where a family packs its own way."""
        return type(self).pack_weights is LlamaForCausalLM.pack_weights and self.kernels.pack is not None

    def pack_layer(self, i: int) -> None:
        """Pack layer i's projections (on the CPU), releasing each weight its pack serves alone."""
        pack, layer = self.kernels.pack, self.layers[i]
        layer.packed = {}
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = getattr(layer, name)
            if w is None:
                continue
            layer.packed[name] = pack(w, gate_up=name == "gate_up_proj")
            if serves_alone(layer.packed[name]):
                setattr(layer, name, released(w))
                self._released[f"layers.{i}.{name}"] = layer.packed[name]
        if layer.moe is not None:
            layer.moe.pack_weights(pack)

    def pack_head(self) -> None:
        """Pack the LM head (the embedding, tied), releasing it where its panels serve alone:
        a tied table too, where the embedding can read its rows from them (one rank)."""
        if not self.pp_last:
            return
        name = "embed_tokens" if self.lm_head is None else "lm_head"
        self.packed_lm_head = self.kernels.pack(getattr(self, name))
        if serves_alone(self.packed_lm_head) and (name == "lm_head" or self.tp is None):
            setattr(self, name, released(getattr(self, name)))
            self._released[name] = self.packed_lm_head

    def cover_positions(self, n_pos: int) -> None:
        """Make the cos/sin tables hold positions 0..n_pos-1 (the kernels index them without a
        bound check): the runner calls this with the longest sequence the engine admits."""
        if n_pos > self.rope_cos.shape[0]:
            device = self.rope_cos.device
            for name, table in self._rope_tables(n_pos).items():
                setattr(self, name, table.to(device))

    def _rope_tables(self, n_pos: int) -> dict[str, torch.Tensor]:
        """The cos/sin buffers for positions 0..n_pos-1 by name (a family with a second pair
        adds it: Gemma 3's local layers')."""
        cos, sin = rope_tables(self.arch, n_pos)
        return {"rope_cos": cos, "rope_sin": sin}

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
        elif self.embed_tokens.device.type == "meta":  # tied: the LM head's panels hold the table
            x = panel_rows_of(self.packed_lm_head, input_ids)
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


_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_BIASED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v biases without attention_bias
_FUSED_IN_CHECKPOINT = "Phi3ForCausalLM"
_MIXTRAL = "MixtralForCausalLM"
# llama.cpp's choice where the file does not say (expert_weights_norm): Qwen2-MoE leaves the
# top-k weights as they come out of the softmax, Qwen3-MoE and Mixtral renormalise them.
_GGUF_NORM_TOPK = {"Qwen2MoeForCausalLM": False}


def _unpacked_state(gone: dict, module, state: dict, prefix: str, local_metadata) -> None:
    """A state_dict hook: released weights back from their panels, bit for bit."""
    for name, packed in gone.items():
        key = prefix + name
        if key in state and state[key].device.type == "meta":
            state[key] = unpack_panels(packed, state[key].shape[0])


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
        names = {name: [hf] for name, hf in self.hf_norm_names(i, arch).items()}
        names.update(qkv_proj=[a + "qkv_proj.weight"] if fused else [a + f"{x}_proj.weight" for x in "qkv"],
                     o_proj=[a + "o_proj.weight"])
        if arch.attention_bias:
            names["qkv_bias"] = [a + f"{x}_proj.bias" for x in "qkv"]
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
