"""The architecture of a model (its shapes and constants), read from an HF config.json or GGUF
metadata: the fields every family shares are read here, each family's own by its file in
kvflow/models/ (kvflow/models/registry.py names the family of an architecture).

No torch at import: the frontend process reads it to size things and to print model facts."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from kvflow.model.attention_pattern import gguf_pattern_fields, hf_pattern_fields, layer_windows
from kvflow.model_path import cache_dir_for, is_gguf
from kvflow.models.registry import check_architecture, family_of, gguf_architecture, hf_architecture
from kvflow.utils.files import publish

_ROPE_TYPES = ("llama3", "linear", "longrope", "yarn")
ARCH_CACHE_FILE = "arch.json"


@dataclass
class LlamaArchConfig:
    """Shapes and constants of one Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) or
    of a relative that differs by the fields at the end (Qwen3, Phi-3, expert models)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    name: str = "model"
    eos_token_ids: list[int] = field(default_factory=list)
    # sliding-window attention (attention_pattern.py): the window, and each layer's type
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Gemma 3: the local layers' RoPE base, the query scale's 1/sqrt(query_pre_attn_scalar)
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Qwen3: per-head RMSNorm on q and k before RoPE. Phi-3: RoPE on the first `rotary_dim`
    # dims of each head (0: all of it).
    qk_norm: bool = False
    rotary_dim: int = 0
    # Mixture of experts (kvflow/layers/moe.py); num_experts 0: every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    decoder_sparse_step: int = 1  # every n-th layer is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim})")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        if self.rope_scaling and self.rope_scaling["rope_type"] == "yarn" \
                and not self.rope_scaling.get("original_max_position_embeddings"):
            raise ValueError("yarn rope scaling needs 'original_max_position_embeddings'")
        if self.rope_scaling and self.rope_scaling["rope_type"] == "longrope":
            self.rope_scaling = _complete_longrope(self.rope_scaling, self.max_position_embeddings)
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rope_dim // 2:
                    raise ValueError(f"longrope {key} has {len(self.rope_scaling[key])} entries; "
                                     f"the rotary dim {self.rope_dim} needs {self.rope_dim // 2}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                             f"and num_experts ({self.num_experts})")
        if not self.eos_token_ids:
            eos = self.eos_token_id
            self.eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to the whole context)."""
        return layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)

    def attention_layers(self) -> list[int]:
        """The layers that hold a KV cache (a hybrid family's others keep a state instead)."""
        return list(range(self.num_hidden_layers))

    def kv_layer_windows(self) -> list[int | None]:
        """The window of each layer that holds a KV cache, in layer order: what the KV cache
        groups are made of."""
        windows = self.layer_windows()
        return [windows[i] for i in self.attention_layers()]

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """The (kv heads, head dim) of each layer that holds a KV cache, in layer order: one
        shape for all but where a family's layers differ (Gemma 4)."""
        return [(self.num_key_value_heads, self.head_dim)] * len(self.attention_layers())

    def state_bytes_per_request(self, dtype_bytes: int) -> int:
        """Bytes of the fixed-size state one request holds across the state layers (0: none)."""
        return 0

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V that one token occupies across all layers, each at its own shape:
        `dtype_bytes` a value, plus `scale_bytes` per token and kv head (an int8 cache's scales, kv_layout.py)."""
        return sum(2 * kv * (d * dtype_bytes + scale_bytes) for kv, d in self.kv_layer_shapes())

    @property
    def rope_dim(self) -> int:
        """How many dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Layer i has a sparse expert block instead of the dense MLP (HF's rule for Qwen-MoE)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        dense = 3 * h * self.intermediate_size
        shared = self.shared_expert_intermediate_size
        moe = (self.num_experts * (h + 3 * h * self.moe_intermediate_size)
               + (3 * h * shared + h if shared else 0))
        mlps = sum(moe if self.is_moe_layer(i) else dense for i in range(self.num_hidden_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * (attn + 2 * h) + mlps + h

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LlamaArchConfig":
        """The config `to_dict` wrote, in its family's config class."""
        return family_of(data["architecture"]).config_class(**data)


def _normalise_rope_scaling(rs: dict | None) -> dict | None:
    if not rs:
        return None
    rs = dict(rs)
    rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    return {"rope_type": rope_type, **rs}


def _complete_longrope(rs: dict, max_position_embeddings: int) -> dict:
    """LongRoPE (Phi-3): the attention factor, where the config leaves it out, as transformers
    derives it from the context extension factor."""
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ValueError(f"longrope scaling needs {key!r}")
    if rs.get("attention_factor") is None:
        original = float(rs["original_max_position_embeddings"])
        factor = rs.get("factor") or max_position_embeddings / original
        rs["attention_factor"] = (math.sqrt(1 + math.log(factor) / math.log(original))
                                  if factor > 1.0 else 1.0)
    return rs


def load_arch_config(path: str) -> LlamaArchConfig:
    """Read the architecture of an HF folder (config.json) or a GGUF file (metadata only)."""
    if is_gguf(path):
        return _from_gguf(path)
    return _from_hf_folder(path)


def _from_hf_folder(path: str) -> LlamaArchConfig:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg else cfg
    architecture = hf_architecture(cfg)
    family = family_of(architecture)
    # transformers 5.x: rope_parameters holds theta and scaling; 4.x: rope_theta + rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = rope_params if rope_params else cfg.get("rope_scaling")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if rope_type in ("longrope", "su"):
        # Phi-3 keeps original_max_position_embeddings beside the scaling, not in it
        rope_scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
                        **rope_scaling}
    elif rope_type == "yarn":  # transformers' order: beside the scaling, in it, the context length
        original = (cfg.get("original_max_position_embeddings")
                    or rope_scaling.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings", 2048))
        rope_scaling = {**rope_scaling, "original_max_position_embeddings": original}
    eos = cfg.get("eos_token_id")
    eos_ids = _eos_list(eos)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # instruct models list extra stop ids (e.g. <|eot_id|>) here
        with open(gen_path) as f:
            eos_ids += [e for e in _eos_list(json.load(f).get("eos_token_id")) if e not in eos_ids]
    fields = dict(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),  # (none where every layer has experts)
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        name=os.path.basename(os.path.normpath(path)),
        eos_token_ids=eos_ids,
        rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
        **hf_pattern_fields(cfg, family.default_sliding_window_pattern),
    )
    fields.update(family.hf_fields(cfg, architecture))  # the family's own fields win
    return family.config_class(**fields)


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _from_gguf(path: str) -> LlamaArchConfig:
    # GGUFReader parses every metadata array (the whole vocabulary), which takes seconds:
    # the result is cached next to the converted weights.
    cached = os.path.join(cache_dir_for(path), ARCH_CACHE_FILE)
    if os.path.isfile(cached):
        try:
            with open(cached) as f:
                return LlamaArchConfig.from_dict(json.load(f))
        except (ValueError, TypeError, KeyError):  # torn or from another version: parse again
            pass
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = arch_from_gguf_reader(reader, path)
    save_arch_cache(arch, path)
    return arch


def save_arch_cache(arch: LlamaArchConfig, path: str) -> None:
    cache = cache_dir_for(path)
    os.makedirs(cache, exist_ok=True)
    tmp = os.path.join(cache, ARCH_CACHE_FILE + f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(arch.to_dict(), f)
    publish(tmp, os.path.join(cache, ARCH_CACHE_FILE))  # fsync, then the atomic rename


def gguf_field(reader, key: str, default=None):
    fld = reader.fields.get(key)
    return default if fld is None else fld.contents()


# End-of-turn tokens that stop generation besides the EOS id, as llama.cpp finds them: by the
# eot/eom keys, or by their text among the control tokens (Qwen's <|im_end|>, Phi-3's <|end|>,
# Llama 3's <|eot_id|>, Gemma's <end_of_turn>), which the HF folder lists in
# generation_config.json and a GGUF file often does not.
_END_OF_TURN_TEXTS = {b"<|im_end|>", b"<|end|>", b"<|eot_id|>", b"<|eom_id|>", b"<end_of_turn>"}
_CONTROL_TOKEN_TYPES = (3, 4)  # gguf TokenType CONTROL, USER_DEFINED


def _gguf_stop_ids(reader, eos) -> list[int]:
    ids = [] if eos is None else [int(eos)]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = gguf_field(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        return ids
    for i, idx in enumerate(tokens.data):
        if (int(types.parts[types.data[i]][0]) in _CONTROL_TOKEN_TYPES
                and bytes(tokens.parts[idx]) in _END_OF_TURN_TEXTS and i not in ids):
            ids.append(i)
    return ids


def _kv_heads(value) -> int:
    """`attention.head_count_kv`: one count, or one per layer (0 for a hybrid model's layers
    without attention, LFM2's): the attention layers' count."""
    if isinstance(value, (list, tuple)):
        return max(int(v) for v in value)
    return int(value)


def _first_layer(value) -> int:
    """`feed_forward_length`: one width, or one per layer (Gemma 4's double-wide MLP on its
    KV-shared layers): the first layer's; the family reads the rest."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def arch_from_gguf_reader(reader, path: str) -> LlamaArchConfig:
    """Map GGUF metadata (`<arch>.block_count` ...) to a LlamaArchConfig."""
    g = gguf_field(reader, "general.architecture")
    architecture = gguf_architecture(g)
    family = family_of(architecture)

    def meta(key, default=None):
        return gguf_field(reader, f"{g}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors = {t.name: t for t in reader.tensors}
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(meta("rope.scaling.factor", 1.0))}
    if "rope_factors_long.weight" in tensors:  # Phi-3 LongRoPE: the factors are tensors
        rope_scaling = {"rope_type": "longrope",
                        "long_factor": tensors["rope_factors_long.weight"].data.tolist(),
                        "short_factor": tensors["rope_factors_short.weight"].data.tolist(),
                        "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                        "attention_factor": meta("rope.scaling.attn_factor")}
    if scaling_type == "yarn" and not family.gguf_reads_yarn:  # llama.cpp's own YaRN keys
        raise ValueError("GGUF files with YaRN rope scaling are not supported yet; "
                         "use the Hugging Face folder of this model")
    if "rope_freqs.weight" in tensors and not family.gguf_reads_rope_freqs:
        raise ValueError("GGUF files with rope_freqs (Llama-3.1 style scaling) are not supported yet; "
                         "use the Hugging Face folder of this model")
    rope_dim = int(meta("rope.dimension_count", head_dim))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    name = os.path.splitext(os.path.basename(path))[0]
    stop_ids = _gguf_stop_ids(reader, eos)
    fields = dict(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_first_layer(meta("feed_forward_length", 0)),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
        name=str(name),
        eos_token_ids=stop_ids,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rotary_dim=0 if rope_dim == head_dim else rope_dim,
        **gguf_pattern_fields(meta, int(meta("block_count")), family.default_sliding_window,
                              family.default_sliding_window_pattern),
    )
    fields.update(family.gguf_fields(meta, tensors, architecture))
    return family.config_class(**fields)
