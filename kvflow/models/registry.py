"""The model registry: a checkpoint's architecture name (config.json's `architectures`, its
`model_type`, or a GGUF file's `general.architecture`) -> the family file that serves it.

A family is one module in kvflow/models/ and one line in FAMILIES below. The registry holds
names only (no torch): it loads a family's module by name when asked, so that the code that
reads configs and weights can reach the family without importing every family. What a family
module provides is kvflow/models/family.py's ModelFamily; what it can run with, its Supports."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Supports:
    """What a family can run with; `check` is the one place a load refuses the rest."""

    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    lora: bool = True
    quantized: bool = True  # projections served as stored (gguf, int8, compressed-tensors)
    decode_step: bool = True  # the one-call C decode step (kvflow/model/decode_graph.py)

    def check(self, family: str, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
              lora: bool = False) -> None:
        """ValueError naming the option a `family` model cannot run with."""
        if tensor_parallel_size > 1 and not self.tensor_parallel:
            raise ValueError(f"{family} does not run tensor-parallel yet; use tensor_parallel_size=1")
        if pipeline_parallel_size > 1 and not self.pipeline_parallel:
            raise ValueError(f"{family} does not run pipeline-parallel yet; use pipeline_parallel_size=1")
        if lora and not self.lora:
            raise ValueError(f"{family} does not take LoRA adapters yet; leave enable_lora off")


@dataclass(frozen=True)
class FamilyEntry:
    """One registry line: the family module's name, its architectures by HF `model_type`,
    llama.cpp's architecture names for them, and vision-language folders whose text part it
    serves."""

    module: str
    architectures: dict[str, str]
    gguf: dict[str, str] = field(default_factory=dict)
    text_part_of: dict[str, str] = field(default_factory=dict)


FAMILIES = (
    FamilyEntry("llama", {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                          "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"},
                {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM"}),
    FamilyEntry("gemma3", {"gemma3_text": "Gemma3ForCausalLM"}, {"gemma3": "Gemma3ForCausalLM"}),
    FamilyEntry("gemma3_mm", {"gemma3": "Gemma3ForConditionalGeneration"}),
    FamilyEntry("qwen3_vl", {"qwen3_vl": "Qwen3VLForConditionalGeneration"}),
    FamilyEntry("gemma4", {"gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForCausalLM"},
                {"gemma4": "Gemma4ForCausalLM"},
                text_part_of={"Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}),
    FamilyEntry("olmo2", {"olmo2": "Olmo2ForCausalLM"}, {"olmo2": "Olmo2ForCausalLM"}),
    FamilyEntry("granite", {"granite": "GraniteForCausalLM"}, {"granite": "GraniteForCausalLM"}),
    FamilyEntry("granitemoehybrid", {"granitemoehybrid": "GraniteMoeHybridForCausalLM"},
                {"granitehybrid": "GraniteMoeHybridForCausalLM"}),
    FamilyEntry("lfm2", {"lfm2": "Lfm2ForCausalLM"}, {"lfm2": "Lfm2ForCausalLM"}),
    FamilyEntry("qwen3_5", {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                            "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                            "qwen3_next": "Qwen3NextForCausalLM"},
                {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM"},
                text_part_of={"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                              "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}),
    FamilyEntry("smollm3", {"smollm3": "SmolLM3ForCausalLM"}, {"smollm3": "SmolLM3ForCausalLM"}),
    FamilyEntry("gpt_oss", {"gpt_oss": "GptOssForCausalLM"}, {"gpt-oss": "GptOssForCausalLM"}),
)

_BY_ARCHITECTURE = {a: e for e in FAMILIES for a in e.architectures.values()}
_BY_MODEL_TYPE = {t: a for e in FAMILIES for t, a in e.architectures.items()}
_BY_GGUF = {g: a for e in FAMILIES for g, a in e.gguf.items()}
_TEXT_PART_OF = {v: t for e in FAMILIES for v, t in e.text_part_of.items()}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)


def hf_architecture(cfg: dict) -> str:
    """The architecture an HF config.json names (its first `architectures` entry, else its
    `model_type`'s); a vision-language folder's text architecture where a family serves it."""
    archs = cfg.get("architectures") or [_BY_MODEL_TYPE.get(cfg.get("model_type"), cfg.get("model_type"))]
    return _TEXT_PART_OF.get(archs[0], archs[0])


def gguf_architecture(name: str) -> str:
    """The architecture of a GGUF file's `general.architecture`; ValueError when no family has it."""
    if name not in _BY_GGUF:
        raise ValueError(f"GGUF architecture {name!r} is not supported ({', '.join(_BY_GGUF)})")
    return _BY_GGUF[name]


def check_architecture(architecture: str) -> None:
    """ValueError naming what kvflow runs when no family serves `architecture`."""
    if architecture not in _BY_ARCHITECTURE:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"kvflow runs {', '.join(SUPPORTED_ARCHITECTURES)}")


def family_of(architecture: str):
    """The ModelFamily (kvflow/models/family.py) that serves `architecture`, its module
    imported on first use."""
    check_architecture(architecture)
    module = importlib.import_module(f"kvflow.models.{_BY_ARCHITECTURE[architecture].module}")
    return module.FAMILY
