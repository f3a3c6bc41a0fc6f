"""Prefix caching on the real default model: reused blocks give the same tokens as recomputing."""
from __future__ import annotations

import json

import pytest

from kvflow import LLM, SamplingParams
from kvflow.core.kv_cache import coordinator

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_shared_prefix_is_reused_and_output_is_unchanged(default_model_path, tmp_path):
    prefix = [(i * 37) % 4000 + 100 for i in range(10 * 16)]  # 10 blocks of 16
    a, b = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    trace = tmp_path / "on.jsonl"
    on = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=64, trace=str(trace))
    first = on.generate([a], GREEDY, use_tqdm=False)[0]
    second = on.generate([b], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 160
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    admitted = [r for s in steps for r in s["requests"] if r.get("cached_tokens")]
    assert len(admitted) == 1 and admitted[0]["cached_tokens"] == 160
    assert admitted[0]["num_computed_tokens"] == 160 and admitted[0]["tokens"] == 5

    off = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=64,
              enable_prefix_caching=False)
    reference = off.generate([b], GREEDY, use_tqdm=False)[0]
    assert reference.num_cached_tokens == 0
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids


def test_parallel_samples_share_their_prompt_blocks(default_model_path, tmp_path):
    trace = tmp_path / "n.jsonl"
    llm = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=64, trace=str(trace))
    prompt = [(i * 53) % 4000 + 100 for i in range(4 * 16 + 3)]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    first_step = json.loads(trace.read_text().splitlines()[0])
    held = [set(r["blocks"]) for r in first_step["requests"]]
    assert len(held) == 3
    shared = held[0] & held[1] & held[2]
    assert len(shared) == 4  # the four full prompt blocks, computed once
    assert [r.get("cached_tokens", 0) for r in first_step["requests"]] == [0, 64, 64]


def test_a_forced_hash_collision_gives_the_same_text_as_prefix_caching_off(default_model_path,
                                                                          monkeypatch):
    """Every block of every prompt gets one hash: a hit must still compare tokens (and the block
    before), so that another prompt's K/V is never served."""
    monkeypatch.setattr(coordinator, "hash_block", lambda parent, data, salt=b"": bytes(32))
    a = [(i * 37) % 4000 + 100 for i in range(6 * 16 + 3)]
    b = [(i * 53) % 4000 + 200 for i in range(6 * 16 + 3)]  # other tokens, the same hashes
    on = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=64)
    on.generate([a], GREEDY, use_tqdm=False)
    second = on.generate([b], GREEDY, use_tqdm=False)[0]
    again = on.generate([a], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert again.num_cached_tokens == 16  # a's first block; the rest collided, never cached
    off = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=64,
              enable_prefix_caching=False)
    reference = off.generate([b, a], GREEDY, use_tqdm=False)
    assert second.outputs[0].text == reference[0].outputs[0].text
    assert second.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert again.outputs[0].token_ids == reference[1].outputs[0].token_ids
