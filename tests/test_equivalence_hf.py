"""Greedy outputs on the default model (fp32) equal Hugging Face transformers', however the
engine batches, chunks or preempts."""
from __future__ import annotations

import json

import pytest

from conftest import NEW_TOKENS, assert_matches_reference
from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kvflow_llm_factory(default_model_path):
    def make(**kw):
        return LLM(default_model_path, dtype="float32", max_model_len=1024, **kw)
    return make


def test_one_at_a_time_matches_hf(kvflow_llm_factory, prompt_ids, hf_reference):
    llm = kvflow_llm_factory(num_blocks=128)
    for i, ids in enumerate(prompt_ids):
        out = llm.generate([ids], GREEDY, use_tqdm=False)[0]
        assert_matches_reference(out.outputs[0].token_ids, hf_reference[i], f"prompt {i}")


def test_all_at_once_with_chunked_prefill_matches_hf(kvflow_llm_factory, prompt_ids, hf_reference, tmp_path):
    trace = tmp_path / "trace.jsonl"
    llm = kvflow_llm_factory(num_blocks=256, max_num_batched_tokens=64, trace=str(trace))
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == prompt_ids[i]
        assert_matches_reference(out.outputs[0].token_ids, hf_reference[i], f"prompt {i}")
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    mixed = [s for s in steps if {r["phase"] for r in s["requests"]} == {"prefill", "decode"}]
    assert mixed, "chunked prefill should have run beside decodes"
    assert all(s["num_scheduled_tokens"] <= 64 for s in steps)
    chunks = [r["tokens"] for s in steps for r in s["requests"] if r["phase"] == "prefill"]
    assert len(set(chunks)) > 2, "chunk sizes should vary with the budget left"


def test_preemption_keeps_outputs_equal_to_hf(kvflow_llm_factory, prompt_ids, hf_reference, tmp_path):
    trace = tmp_path / "trace.jsonl"
    longest = max(len(ids) for ids in prompt_ids) + NEW_TOKENS
    llm = kvflow_llm_factory(num_blocks=-(-longest // 16) + 4, max_num_batched_tokens=64,
                             trace=str(trace))
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["preempted"] for s in steps), "the small pool should have forced a preemption"
    for i, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, hf_reference[i], f"prompt {i}")
    assert steps[-1]["free_blocks"] == steps[-1]["num_blocks"]
