"""Speculative decoding end to end on tiny random models (fp32): greedy outputs with n-gram or
draft-model speculation equal the target alone, token for token, over a mixed batch with
chunked prefill and preemption; seeded random sampling reproduces; acceptance is reported.
And on the default model in each dtype and weight format it is served in (fp32, fp32 with
bf16-stored weights, bf16, the Q4_1 file as stored): n-gram outputs equal plain decoding's,
with the verification steps in the one-call decode step."""
from __future__ import annotations

import json

import pytest

from conftest_model_helpers import save_tiny_llama3
from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.engine.protocol import EngineCoreRequest
from kvflow.model.cpu_features import cpu_features
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return (save_tiny_llama3(str(root / "target"), seed=0),
            save_tiny_llama3(str(root / "draft"), seed=1))


def prompts():
    # repetitive prompts, so n-gram lookup finds matches; lengths mixed, one long
    base = [[10 + (i % 7) for i in range(n)] for n in (5, 13, 40)]
    return base + [[20, 21, 22, 23] * 6, [50 + i for i in range(70)]]


def run(model, spec=None, num_blocks=40, budget=24, params=None, trace=None):
    config = EngineConfig(model_config=ModelConfig(model=model, dtype="float32"),
                          cache_config=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler_config=SchedulerConfig(max_num_batched_tokens=budget),
                          warmup=False, speculative_config=spec, trace=trace)
    core = EngineCore(config)
    try:
        for i, p in enumerate(prompts()):
            sp = params[i] if params else SamplingParams(max_tokens=24 + 4 * i, temperature=0,
                                                         ignore_eos=True)
            core.add_request(EngineCoreRequest(f"r{i}", p, sp))
        out: dict[str, list[int]] = {}
        preemptions = 0
        stats = None
        while core.has_unfinished_requests():
            step = core.step()
            stats = step.scheduler_stats
            preemptions += stats.num_preemptions
            for o in step.outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_total_blocks  # nothing leaked
        return out, preemptions, stats, core.scheduler.spec_stats
    finally:
        core.shutdown()


def test_greedy_with_ngram_equals_without_under_chunking_and_preemption(tiny_pair):
    target, _ = tiny_pair
    want, _, _, _ = run(target)
    got, preemptions, stats, spec = run(
        target, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        num_blocks=30)
    assert got == want
    assert preemptions > 0
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert stats.spec_decode_num_draft_tokens == spec.num_draft_tokens


def test_draft_model_outputs_equal_the_target_alone(tiny_pair):
    target, draft = tiny_pair
    want, _, _, _ = run(target)
    got, preemptions, _, spec = run(
        target, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
        num_blocks=34)
    assert got == want
    assert preemptions > 0 and spec.num_draft_tokens > 0


def test_a_draft_model_equal_to_the_target_has_its_drafts_accepted(tiny_pair, tmp_path):
    target, _ = tiny_pair
    trace = str(tmp_path / "trace.jsonl")
    want, _, _, _ = run(target)
    got, _, _, spec = run(target, {"method": "draft_model", "model": target,
                                   "num_speculative_tokens": 4}, num_blocks=200, trace=trace)
    assert got == want
    # its own cache is right: the same model proposes what the target then picks
    assert spec.acceptance_rate > 0.9
    entries = [r for line in open(trace) for r in json.loads(line)["requests"] if "drafted" in r]
    assert entries and all(0 <= e["accepted"] <= e["drafted"] for e in entries)


def test_seeded_sampling_with_speculation_reproduces(tiny_pair):
    target, _ = tiny_pair
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=7 + i, ignore_eos=True)
              for i in range(5)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    a, _, _, sa = run(target, spec, num_blocks=200, params=params)
    b, _, _, _ = run(target, spec, num_blocks=200, params=params)
    assert a == b and sa.num_draft_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_pair, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    target, _ = tiny_pair
    other = str(tmp_path / "other")
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                 max_position_embeddings=512)).save_pretrained(other)
    config = EngineConfig(model_config=ModelConfig(model=target, dtype="float32"), warmup=False,
                          cache_config=CacheConfig(block_size=4, num_blocks=16),
                          speculative_config={"method": "draft_model", "model": other})
    with pytest.raises(ValueError, match="vocabulary"):
        EngineCore(config)


# copy-heavy prompts (n-gram lookup finds the answer in them)
COPY_PROMPTS = [
    "Repeat this code exactly:\n\ndef area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n"
    "    return 2 * (w + h)\n",
    "Copy this text word for word: A cache keeps a copy of data close to where it is used, so "
    "that the next request for the same data is answered quickly.",
]
FORMATS = {"fp32": dict(quantization="none", dtype="float32"),
           "fp32-bf16-weights": dict(quantization="none", dtype="float32", weight_dtype="bfloat16"),
           "bf16": dict(quantization="none", dtype="bfloat16"),
           "q4_1": dict()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ngram_on_the_default_model_equals_plain_decoding(fmt, default_model_path, monkeypatch):
    from kvflow import LLM
    if fmt == "bf16":
        # bf16 on the panel GEMM, whose rows do not depend on the batch: AMX's tiles (bf16
        # batches past 4 rows on CPUs with AMX, over the panels or oneDNN's copy) sum in another
        # order, so there bf16 outputs may change with the batch, speculation's included
        # (docs/speculative_decoding.md); with neither, the panels take every batch
        monkeypatch.setenv("KVFLOW_NO_ONEDNN", "1")
        monkeypatch.setenv("KVFLOW_NO_AMX_PANELS", "1")
    llm = LLM(default_model_path, **FORMATS[fmt], num_blocks=64, max_model_len=512,
              warmup=False, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    try:
        core = llm.engine.core
        ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False) for p in COPY_PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=32)
        graph = core.executor.runner.model._graph()
        # bf16 takes the one-call step on the panel GEMM only (AVX512-BF16); elsewhere its
        # projections are torch's, layer by layer, and only the equality is checked
        one_call = fmt != "bf16" or cpu_features().avx512_bf16
        steps = []  # the verification steps' rows, and whether the one call took them
        if one_call:
            assert graph is not None and core.spec.policy.one_call_rows == graph.max_rows >= 5
            run = graph.run
            graph.run = lambda x, *a: steps.append((x.shape[0], (out := run(x, *a)) is not None)) or out
        else:
            assert graph is None
        # one stream, then both prompts in one batch
        got = llm.generate(ids[:1], params, use_tqdm=False) + llm.generate(ids, params, use_tqdm=False)
        accepted = core.scheduler.spec_stats.num_accepted_tokens
        spec, core.spec = core.spec, None  # the same engine without drafts: plain decoding
        try:
            want = (llm.generate(ids[:1], params, use_tqdm=False)
                    + llm.generate(ids, params, use_tqdm=False))
        finally:
            core.spec = spec
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert accepted > 16
        if one_call:
            assert any(rows > 2 for rows, _ in steps)
            assert all(taken for rows, taken in steps if rows <= graph.max_rows)
    finally:
        llm.engine.shutdown()
