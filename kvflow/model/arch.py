"""Architecture of a Llama-family model, read from an HF config.json or GGUF metadata.

No torch here: the frontend process reads it to size things and to print model facts."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from kvflow.model.attention_pattern import gguf_pattern_fields, hf_pattern_fields, layer_windows
from kvflow.model_path import cache_dir_for, is_gguf
from kvflow.utils.files import publish

# model_type -> architecture name, for config.json files saved without "architectures".
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}
# Gemma 3 (text); a Gemma3ForConditionalGeneration checkpoint loads its text part
_MODEL_TYPES.update({"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForCausalLM"})
_TEXT_PART_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(_MODEL_TYPES.values()))
_ROPE_TYPES = ("llama3", "linear")
ARCH_CACHE_FILE = "arch.json"


@dataclass
class LlamaArchConfig:
    """Shapes and constants of one Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2)."""

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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"kvflow runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        if not self.eos_token_ids:
            eos = self.eos_token_id
            self.eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to the whole context)."""
        return layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * layer + h

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LlamaArchConfig":
        return cls(**data)


def _normalise_rope_scaling(rs: dict | None) -> dict | None:
    if not rs:
        return None
    rs = dict(rs)
    rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    return {"rope_type": rope_type, **rs}


def load_arch_config(path: str) -> LlamaArchConfig:
    """Read the architecture of an HF folder (config.json) or a GGUF file (metadata only)."""
    if is_gguf(path):
        return _from_gguf(path)
    return _from_hf_folder(path)


def _from_hf_folder(path: str) -> LlamaArchConfig:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg else cfg
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))]
    architecture = _TEXT_PART_OF.get(archs[0], archs[0])
    # transformers 5.x: rope_parameters holds theta and scaling; 4.x: rope_theta + rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = rope_params if rope_params else cfg.get("rope_scaling")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = _eos_list(eos)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # instruct models list extra stop ids (e.g. <|eot_id|>) here
        with open(gen_path) as f:
            eos_ids += [e for e in _eos_list(json.load(f).get("eos_token_id")) if e not in eos_ids]
    pattern = hf_pattern_fields(cfg, architecture)  # windows; Gemma 3's own RoPE and scales
    rope_theta = pattern.pop("rope_theta", rope_theta)
    rope_scaling = pattern.pop("rope_scaling", rope_scaling)
    return LlamaArchConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
        attention_bias=bool(cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        name=os.path.basename(os.path.normpath(path)),
        eos_token_ids=eos_ids,
        **pattern,
    )


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


def arch_from_gguf_reader(reader, path: str) -> LlamaArchConfig:
    """Map GGUF metadata (`<arch>.block_count` ...) to a LlamaArchConfig."""
    g = gguf_field(reader, "general.architecture")
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM"}.get(g)
    if architecture is None:
        raise ValueError(f"GGUF architecture {g!r} is not supported (llama, qwen2, gemma3)")

    def meta(key, default=None):
        return gguf_field(reader, f"{g}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(meta("rope.scaling.factor", 1.0))}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama-3.1 style scaling) are not supported yet; "
                         "use the Hugging Face folder of this model")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    name = os.path.splitext(os.path.basename(path))[0]
    eos_ids = _eos_list(None if eos is None else int(eos))
    eos_ids += [i for i in _end_of_turn_ids(reader) if i not in eos_ids]
    return LlamaArchConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
        name=str(name),
        eos_token_ids=eos_ids,
        **gguf_pattern_fields(meta, architecture, int(meta("block_count"))),
    )


_END_OF_TURN_TOKENS = ("<end_of_turn>",)  # chat models whose GGUF names only <eos> as its EOS


def _end_of_turn_ids(reader) -> list[int]:
    """Ids of end-of-turn tokens in a GGUF vocabulary (HF's generation_config lists them as
    EOS beside `<eos>`; the GGUF keeps only the one eos_token_id)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    wanted = {t.encode() for t in _END_OF_TURN_TOKENS}
    return [i for i, idx in enumerate(tokens.data) if bytes(tokens.parts[idx]) in wanted]
