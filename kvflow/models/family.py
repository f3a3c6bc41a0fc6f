"""What a model family file provides: a ModelFamily whose methods the shared code calls (the
config reader, the checkpoint readers, the loader, the sharding, the one check at load).

The defaults are the Llama layout (HF's `model.layers.N.self_attn.q_proj.weight` names fused
into kvflow's qkv_proj / gate_up_proj, llama.cpp's common tensor names): a family overrides
what differs. A family file is one module in kvflow/models/ ending in `FAMILY = ...` plus its
line in kvflow/models/registry.py."""
from __future__ import annotations

import torch

from kvflow.model.arch import LlamaArchConfig
from kvflow.models.registry import Supports


class ModelFamily:
    """One family: its name in messages, what it supports, its config class and fields, its
    checkpoint names, and its module."""

    name = "model"
    supports = Supports()
    config_class: type = LlamaArchConfig
    # how its prompts take images: a key of kvflow/multimodal/processor.py's PROCESSORS (None:
    # text only; a folder of such a family without a vision config is text only too)
    image_processor: str | None = None

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        """This family's own config fields from an HF config.json (beyond the shared ones)."""
        return {}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        """The same from GGUF metadata (`meta(key)` reads `<arch>.<key>`; `tensors` by name);
        may also name a more specific `architecture` (Mixtral: llama with experts)."""
        return {}

    def gguf_layer_names(self, architecture: str) -> dict[str, str]:
        """llama.cpp's per-layer tensor names that differ from the common table
        (kvflow/checkpoint/gguf.py), mapped to this family's HF names."""
        return {}

    # llama.cpp's model-wide tensor names that differ from the common table, mapped to HF's
    gguf_global_names: dict[str, str] = {}

    def gguf_permutes_qk(self, architecture: str) -> bool:
        """llama.cpp permuted this architecture's q/k rows for interleaved RoPE at conversion."""
        return False

    gguf_norm_shift = 0.0  # llama.cpp stores some families' norm weights as shift + w
    gguf_reads_yarn = False  # its gguf_fields read llama.cpp's YaRN keys (gpt-oss)
    gguf_reads_rope_freqs = False  # its gguf_fields read the `rope_freqs` tensor (Gemma 4)

    def gguf_tensor(self, name: str, w, arch: LlamaArchConfig):
        """(HF name, tensor) of a GGUF tensor already under `name`: undoes what llama.cpp's
        converter did to this family's tensors beyond renaming them (a numpy float32 array)."""
        return name, w

    # sliding-window defaults where a family's checkpoints leave them out (Gemma 3's files)
    default_sliding_window: int | None = None
    default_sliding_window_pattern: int | None = None  # every n-th layer global

    # the model-wide tensors: kvflow's name -> HF's
    hf_global_names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                       "lm_head": "lm_head.weight"}

    def hf_norm_names(self, i: int, arch: LlamaArchConfig) -> dict[str, str]:
        """Layer i's norms, which every tensor-parallel rank holds whole (QK-norm's weights
        span one head): kvflow's name -> HF's."""
        p = f"model.layers.{i}."
        names = {n: p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm")}
        if arch.qk_norm:
            names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
        return names

    def norm_weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A norm's HF weight (in the model's dtype, as the checkpoint readers hand it over)
        -> the tensor the module holds (Gemma's: the fp32 multiplier 1 + w)."""
        return w.to(dtype)

    def hf_name(self, stored: str) -> str:
        """A checkpoint's tensor name -> the name this family's HF names use (a vision-language
        folder's text part under the text model's names)."""
        return stored

    def hf_layer_names(self, i: int, arch: LlamaArchConfig) -> dict[str, list[str]]:
        """Layer i's dense tensors: kvflow's name -> the HF names whose rows it concatenates
        (one name: a tensor the checkpoint already fuses)."""
        raise NotImplementedError

    def fuse_experts(self, get, arch: LlamaArchConfig, i: int) -> dict[str, torch.Tensor]:
        """Layer i's expert block under kvflow's names (families with experts)."""
        raise ValueError(f"{self.name} has no expert layers")

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """HF parameter names -> kvflow's (qkv_proj = [q; k; v], gate_up_proj = [gate; up];
        an expert layer's weights stacked per expert, kvflow/layers/moe.py)."""
        get = getter(hf, dtype)
        names = dict(self.hf_global_names)
        if arch.tie_word_embeddings:
            del names["lm_head"]
        out = {name: get(hf_name) for name, hf_name in names.items()}
        for i in range(arch.num_hidden_layers):
            for name, parts in self.hf_layer_names(i, arch).items():
                out[f"layers.{i}.{name}"] = get(parts[0]) if len(parts) == 1 else torch.cat([get(p) for p in parts])
            if arch.is_moe_layer(i):
                out.update(self.fuse_experts(get, arch, i))
        return {k: v.contiguous() for k, v in out.items()}

    def model_class(self, arch: LlamaArchConfig) -> type[torch.nn.Module]:
        """The module that runs `arch`."""
        raise NotImplementedError


def getter(hf: dict[str, torch.Tensor], dtype: torch.dtype):
    """hf[name] in `dtype`, or a ValueError naming the missing weight."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        return hf[name].to(dtype)
    get.has = hf.__contains__  # for families whose tensors come under two spellings
    return get
