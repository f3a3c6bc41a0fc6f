"""Quantized serving end to end: which mode a model gets (`quantization`), and a quantized
model's logits against the float model's on the same weights (the default GGUF served as
stored; a float model quantized to int8 W8A8 at load)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.model.quant.load import resolve_quantization


def test_quantization_defaults_to_gguf_for_a_gguf_file_only(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "hf"
    folder.mkdir()
    assert resolve_quantization(None, str(gguf)) == "gguf"
    assert resolve_quantization(None, str(folder)) == "none"
    assert resolve_quantization("int8", str(folder)) == "int8"
    assert resolve_quantization("none", str(gguf)) == "none"
    # a GGUF file is sharded as stored (gguf_shard.py); int8 W8A8 is not, and is refused
    assert resolve_quantization(None, str(gguf), tp_size=2) == "gguf"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_quantization("int8", str(folder), tp_size=2)
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve_quantization("gguf", str(folder))
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("awq", str(folder))
    with pytest.raises(ValueError, match="quantization must be gguf, int8, compressed-tensors, mxfp4 or none"):
        ModelConfig(quantization="q4")


CORPUS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "quant_corpus.txt")


def _logits(model, ids: list[int]) -> torch.Tensor:
    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches

    bs = 16
    caches = allocate_kv_caches(model.arch, -(-len(ids) // bs), bs, model.dtype)
    meta = build_attention_metadata(np.array([len(ids)]), np.array([len(ids)]),
                                    [list(range(-(-len(ids) // bs)))], bs)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches, meta))


def _agreement_and_kl(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return (ref.argmax(-1) == got.argmax(-1)).float().mean().item(), kl


@pytest.mark.slow
def test_default_gguf_served_quantized_follows_the_float_model(default_model_path, default_tokenizer):
    """The Q4_1 file served as stored (int8 activations) against the same weights in fp32,
    teacher-forced over 256 tokens of the corpus: 96.9% agreement and KL 0.003 when written."""
    from kvflow.model.loader import load_model

    ids = default_tokenizer.encode(open(CORPUS).read())[:256]
    ref_model, _ = load_model(default_model_path, torch.float32, quantization="none")
    ref = _logits(ref_model, ids)
    del ref_model
    model, _ = load_model(default_model_path, torch.float32, quantization="gguf")
    layer = model.layers[0]
    assert layer.packed["qkv_proj"].quant.kind == "q4" and layer.packed["qkv_proj"].quant.source == "Q4_1"
    assert model.packed_lm_head.quant.source == "Q8_0"  # the tied embedding's own type
    assert model.embed_tokens.device.type == "meta"  # no float copy of any quantized weight
    agree, kl = _agreement_and_kl(ref, _logits(model, ids))
    assert agree >= 0.9 and kl < 0.02, (agree, kl)


@pytest.mark.slow
def test_int8_w8a8_of_a_float_model_follows_it(tmp_path):
    from conftest_model_helpers import save_tiny_llama3

    from kvflow.model.loader import load_model

    path = save_tiny_llama3(str(tmp_path / "tiny"))
    ids = list(np.random.default_rng(0).integers(0, 320, 96))
    ref_model, _ = load_model(path, torch.float32)
    model, _ = load_model(path, torch.float32, quantization="int8")
    q = model.layers[0].packed["gate_up_proj"].quant
    assert q.per_row and q.source == "int8"
    agree, kl = _agreement_and_kl(_logits(ref_model, ids), _logits(model, ids))
    assert agree >= 0.9 and kl < 0.01, (agree, kl)


@pytest.mark.slow
def test_llm_serves_the_default_model_quantized_by_default():
    from kvflow import LLM, SamplingParams

    llm = LLM(max_model_len=256, num_blocks=32)
    model = llm.engine.core.executor.runner.model
    assert model.layers[0].packed["o_proj"].quant is not None
    assert "linear=quant-" in llm.engine.core.startup_report()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
