"""Hugging Face's SmolLM3 (SmolLM3ForCausalLM): the Llama decoder in which some layers attend
without positional encoding ("NoPE"): `no_rope_layers[i]` is 1 where layer i rotates q and k,
0 where it does not (by default every `no_rope_layer_interval`-th layer, 4, skips RoPE), as
Hugging Face's SmolLM3Attention does. llama.cpp's `smollm3` GGUF files carry no key for the
pattern: llama.cpp fixes it at every fourth layer, and so does the GGUF reading here."""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.model.arch import LlamaArchConfig
from kvflow.models.llama import LlamaDecoderLayer, LlamaFamily, LlamaForCausalLM
from kvflow.models.registry import Supports

_GGUF_NO_ROPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for smollm3


@dataclass
class SmolLM3ArchConfig(LlamaArchConfig):
    no_rope_layers: list[int] | None = None  # per layer: 1 rotates q and k, 0 does not


def _every_nth_without_rope(num_layers: int, interval: int) -> list[int]:
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: SmolLM3ArchConfig, *args, layer_idx: int = 0, **kwargs):
        super().__init__(arch, *args, layer_idx=layer_idx, **kwargs)
        self.use_rope = bool(arch.no_rope_layers[layer_idx])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    decoder_layer = SmolLM3DecoderLayer


class SmolLM3Family(LlamaFamily):
    name = "SmolLM3"
    # the one-call C step rotates every layer; one rank, no adapters (not tested yet)
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False, decode_step=False)
    config_class = SmolLM3ArchConfig

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        n = cfg["num_hidden_layers"]
        layers = cfg.get("no_rope_layers") or _every_nth_without_rope(
            n, int(cfg.get("no_rope_layer_interval") or 4))
        if len(layers) < n or any(x not in (0, 1) for x in layers[:n]):
            raise ValueError(f"no_rope_layers must hold 0 or 1 for each of {n} layers")
        return {**super().hf_fields(cfg, architecture), "no_rope_layers": [int(x) for x in layers[:n]]}

    def gguf_fields(self, meta, tensors: dict, architecture: str) -> dict:
        n = int(meta("block_count"))
        return {"no_rope_layers": _every_nth_without_rope(n, _GGUF_NO_ROPE_INTERVAL)}

    def gguf_permutes_qk(self, architecture: str) -> bool:
        return True  # converted by llama.cpp's LlamaModel, q and k rows permuted as Llama's

    def model_class(self, arch: LlamaArchConfig) -> type[LlamaForCausalLM]:
        return SmolLM3ForCausalLM


FAMILY = SmolLM3Family()
