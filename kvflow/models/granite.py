"""IBM's Granite 3 (GraniteForCausalLM): the Llama decoder with four multipliers, as Hugging
Face's GraniteForCausalLM applies them: the embeddings times `embedding_multiplier`, each
attention and MLP output times `residual_multiplier` before it joins the residual stream,
attention scores scaled by `attention_multiplier` (instead of 1/sqrt(head_dim)), and the
logits divided by `logits_scaling`. llama.cpp's `granite` GGUF files carry them as
`granite.embedding_scale`, `.residual_scale`, `.attention.scale` and `.logit_scale`."""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.model.arch import LlamaArchConfig
from kvflow.models.llama import LlamaFamily, LlamaForCausalLM
from kvflow.models.registry import Supports


@dataclass
class GraniteArchConfig(LlamaArchConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteForCausalLM(LlamaForCausalLM):
    """The Llama module with Granite's multipliers set on it and its layers."""

    def __init__(self, arch: GraniteArchConfig, *args, **kwargs):
        super().__init__(arch, *args, **kwargs)
        self.embed_scale, self.logits_scaling = arch.embedding_multiplier, arch.logits_scaling
        for layer in self.layers:
            layer.attn.scale, layer.residual_scale = arch.attention_multiplier, arch.residual_multiplier


class GraniteFamily(LlamaFamily):
    name = "Granite"
    # the multipliers are not in the one-call C step; one rank, no adapters (not tested yet)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, decode_step=False)
    config_class = GraniteArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        return {**super().hf_fields(cfg, architecture),
                **{key: float(cfg.get(key, 1.0)) for key in ("embedding_multiplier", "residual_multiplier",
                                                             "attention_multiplier", "logits_scaling")}}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        return {"embedding_multiplier": float(meta("embedding_scale", 1.0)),
                "residual_multiplier": float(meta("residual_scale", 1.0)),
                "attention_multiplier": float(meta("attention.scale", 1.0)),
                "logits_scaling": float(meta("logit_scale", 1.0))}

    def gguf_permutes_qk(self, architecture: str) -> bool:
        return True  # converted as a Llama model

    def model_class(self, arch: LlamaArchConfig) -> type[LlamaForCausalLM]:
        return GraniteForCausalLM


FAMILY = GraniteFamily()
