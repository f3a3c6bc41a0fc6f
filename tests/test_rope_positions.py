"""The RoPE tables hold every position the engine admits: sequences past the model's
max_position_embeddings (a user's --max-model-len above it) or past the default table's rows
get HF's numbers (transformers computes cos/sin for any position) in the one-call decode step
and layer by layer, and a model's tables grow only as far as the cache can hold a sequence."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest_model_helpers import TINY, save_byte_tokenizer
from kvflow.model.arch import load_arch_config
from kvflow.layers.rotary import rope_tables
from kvflow.worker.model_runner import longest_position

CONTEXT = 48  # the tiny model's max_position_embeddings; the prompts run far past it


@pytest.fixture(scope="module")
def short_context_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("short-context"))
    torch.manual_seed(0)
    config = LlamaConfig(**dict(TINY, max_position_embeddings=CONTEXT), tie_word_embeddings=False,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    save_byte_tokenizer(path)
    return path, hf


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["one-call", "per-layer"])
def test_positions_past_the_models_context_give_hfs_tokens(short_context_llama, graph, monkeypatch):
    from kvflow import LLM, SamplingParams

    if graph == "per-layer":
        monkeypatch.setenv("KVFLOW_NO_DECODE_GRAPH", "1")
    path, hf = short_context_llama
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((150, 61))]
    llm = LLM(path, dtype="float32", max_model_len=256, num_blocks=64, block_size=16)
    model = llm.engine.core.executor.runner.model
    assert model.rope_cos.shape[0] == 256 > CONTEXT  # max_model_len, within the cache's 1024 tokens
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 24)
    llm.engine.shutdown()


def test_tables_grow_to_the_longest_admitted_sequence_and_keep_their_rows(short_context_llama):
    from kvflow.model.loader import load_model

    path, _ = short_context_llama
    model, arch = load_model(path, torch.float32)
    assert model.rope_cos.shape[0] == CONTEXT
    before = model.rope_cos.clone()
    model.cover_positions(300)
    want_cos, want_sin = rope_tables(arch, 300)
    assert torch.equal(model.rope_cos, want_cos) and torch.equal(model.rope_sin, want_sin)
    assert torch.equal(model.rope_cos[:CONTEXT], before)
    model.cover_positions(100)  # never shrinks
    assert model.rope_cos.shape[0] == 300


def test_longest_position_is_bounded_by_the_cache_unless_windows_let_sequences_outgrow_it(
        short_context_llama):
    arch = load_arch_config(short_context_llama[0])
    assert longest_position(arch, 0, 64, 16) == CONTEXT  # the model's context by default
    assert longest_position(arch, 4096, 64, 16) == 1024  # no sequence outgrows the cache
    assert longest_position(arch, 200, 64, 16) == 200
    windowed = dataclasses.replace(arch, sliding_window=32,
                                   layer_types=["sliding_attention"] * arch.num_hidden_layers)
    assert windowed.layer_windows() == [32] * arch.num_hidden_layers
    assert longest_position(windowed, 4096, 64, 16) == 4096


def test_gemma3_tables_grow_for_global_and_local_layers(tmp_path):
    from kvflow.models.gemma3 import Gemma3ForCausalLM
    from window_model_helpers import save_tiny_gemma3

    arch = load_arch_config(save_tiny_gemma3(str(tmp_path)))
    model = Gemma3ForCausalLM(arch, torch.float32, device="meta")
    rows = model.rope_cos.shape[0]
    local_before = model.rope_local_cos.clone()
    model.cover_positions(rows + 100)
    assert model.rope_cos.shape[0] == model.rope_local_sin.shape[0] == rows + 100
    assert torch.equal(model.rope_local_cos[:rows], local_before)
    assert not torch.equal(model.rope_cos[rows:], model.rope_local_cos[rows:])  # two thetas
