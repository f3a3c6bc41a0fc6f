"""Sliding-window models (Gemma 3's interleaved local/global layers, Mistral with a window,
Qwen2 with use_sliding_window) agree with Hugging Face transformers on the same weights:
fp32 logits over a batch of prompts longer than the window, run together with chunked
prefill through the hybrid KV cache manager, and greedy tokens over 32 steps through the
engine, while the windows' old blocks go back to the pool."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest_model_helpers import hf_logits, save_byte_tokenizer
from kvflow import LLM, SamplingParams
from kvflow.core.kv_cache.groups import make_kv_cache_groups
from kvflow.core.kv_cache.spec import SlidingWindowSpec
from kvflow.model.arch import load_arch_config
from kvflow.model.loader import load_model
from window_model_helpers import SAVERS, WINDOW, WindowedPagedDriver, save_tiny_gemma3, save_tiny_gguf

pytestmark = pytest.mark.slow  # loads models (make test-fast leaves it out)

torch.set_num_threads(1)
ATOL = 1e-4
SEQ_LENS = {"a": 19, "b": 30, "c": 5, "d": 12}  # three of four longer than the window
DECODE_STEPS = 4
STEPS = 32


@pytest.fixture(scope="module", params=list(SAVERS))
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    SAVERS[request.param](path)
    save_byte_tokenizer(path)
    return request.param, path


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32).eval()


def test_each_attention_layer_declares_the_spec_of_its_kv_cache_group(tiny):
    """The scheduler's groups (from the config's windows) and the model's attention layers
    agree on every layer's KV cache spec."""
    _, path = tiny
    model, arch = load_model(path, torch.float32)
    declared = [layer.attn.kv_cache_spec() for layer in model.layers]
    assert SlidingWindowSpec(WINDOW, num_kv_heads=arch.num_key_value_heads, head_size=arch.head_dim) in declared
    for group in make_kv_cache_groups(arch.layer_windows(), arch.kv_layer_shapes()):
        assert {declared[i] for i in group.layers} == {group.spec}


def test_chunked_prefill_batch_logits_match_hf(tiny, hf_model):
    name, path = tiny
    model, arch = load_model(path, torch.float32)
    assert any(w == WINDOW for w in arch.layer_windows()), f"{name}: no sliding-window layer"
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, arch.vocab_size, n + DECODE_STEPS).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf_model, ids) for sid, ids in tokens.items()}
    driver = WindowedPagedDriver(model, arch)
    # chunks of varying size beside decodes; every prompt but c's outgrows the window
    plan_steps = [{"c": 5, "a": 7, "b": 10, "d": 3}, {"c": 1, "a": 12, "b": 10, "d": 9},
                  {"c": 1, "a": 1, "b": 10, "d": 1}, {"a": 1, "b": 1, "c": 1, "d": 1},
                  {"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 1, "b": 1, "d": 1}, {"b": 1}]
    pos = dict.fromkeys(SEQ_LENS, 0)
    for plan in plan_steps:
        out = driver.step([(sid, tokens[sid][pos[sid]:pos[sid] + n]) for sid, n in plan.items()])
        for sid, n in plan.items():
            torch.testing.assert_close(out[sid], refs[sid][pos[sid]:pos[sid] + n], atol=ATOL, rtol=1e-4)
            pos[sid] += n
    assert pos == {sid: n + DECODE_STEPS for sid, n in SEQ_LENS.items()}
    # each sliding group holds only what its window reads: the blocks before it went back
    kv = driver.kv
    for g, group in enumerate(driver.groups):
        if group.sliding_window is None:
            continue
        for sid, n in SEQ_LENS.items():
            table = kv.managers[g].req_to_blocks[sid]
            held = sum(b is not kv.null_block for b in table)
            assert held <= -(-WINDOW // driver.block_size) + 1, (sid, held)
            if n + DECODE_STEPS > 2 * WINDOW:
                assert held < len(table), sid


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_gguf_conversion_loads_to_the_same_logits(name, tmp_path):
    """The model written as llama.cpp writes GGUF (its names, permuted q/k for llama,
    Gemma's 1 + w norms, the window pattern) loads to HF's logits. (Qwen2's window has no
    GGUF form: llama.cpp's qwen2 ignores it.)"""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / name)
    if name == "gemma3":  # GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim)
        save_tiny_gemma3(folder, query_pre_attn_scalar=16)
    else:
        SAVERS[name](folder)
    gguf_file = save_tiny_gguf(folder, str(tmp_path / f"{name}.gguf"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, arch = load_model(gguf_file, torch.float32)
    assert arch.layer_windows() == load_arch_config(folder).layer_windows()
    assert WINDOW in arch.layer_windows()
    rng = np.random.default_rng(3)
    tokens = {sid: rng.integers(0, arch.vocab_size, n).tolist() for sid, n in (("a", 21), ("b", 13))}
    driver = WindowedPagedDriver(model, arch)
    first = driver.step([("a", tokens["a"][:9]), ("b", tokens["b"])])
    rest = driver.step([("a", tokens["a"][9:])])
    torch.testing.assert_close(torch.cat([first["a"], rest["a"]]), hf_logits(hf, tokens["a"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(first["b"], hf_logits(hf, tokens["b"]), atol=ATOL, rtol=1e-4)


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_match_hf_and_windows_free_blocks_while_decoding(tiny, hf_model, tmp_path):
    """Prompts of different lengths, batched with chunked prefill (16-token budget), 32
    greedy tokens each: the same tokens as HF; and while the long request decodes alone, its
    local layers' blocks return to the pool (the trace's free-block count rises on steps
    where nothing finishes)."""
    name, path = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 300, n).tolist() for n in (9, 21, 40)]
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, dtype="float32", max_model_len=128, num_blocks=64, block_size=4,
              max_num_batched_tokens=16, trace=str(trace), warmup=False)
    params = [SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=STEPS + 24, temperature=0.0, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out, p in zip(prompts, outs, params):
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, ids, p.max_tokens), name
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    alone = [s for s in steps if len(s["requests"]) == 1 and s["requests"][0]["phase"] == "decode"]
    assert len(alone) > 2 * WINDOW
    rises = [b["free_blocks"] - a["free_blocks"] for a, b in zip(alone, alone[1:])
             if not b["finished"] and b["step"] == a["step"] + 1]
    assert any(r > 0 for r in rises), f"{name}: no block came back while decoding"
    # a full-attention group keeps growing, so the total held stays below the no-window count
    kv = llm.engine.core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks  # all back (the null block is not counted)
