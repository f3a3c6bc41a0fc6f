"""Speculative decoding under tensor and pipeline parallelism: proposals are made on the driver
(n-gram lookup over token ids; a draft model unsharded in the driver's process) and the
target's verification forward runs sharded over the ranks, or through the stages (the last one
verifies and samples). Greedy outputs with TP=2 or PP=2 and speculation equal one process
without it, token for token (fp32), with chunked prefill, preemption, a stop string and n > 1
in the batch."""
from __future__ import annotations

import json

import pytest

from conftest_model_helpers import save_tiny_llama3
from kvflow.entrypoints.llm import LLM
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# a 24-token budget cuts the long prompts into chunks; 28 blocks of 4 tokens cannot hold the
# whole batch at its longest, so requests are preempted and recomputed
ENGINE = dict(dtype="float32", max_model_len=256, num_threads=1, quantization="none",
              max_num_batched_tokens=24, block_size=4, num_blocks=28, warmup=False)
# repetitive prompts (n-gram lookup finds matches), lengths mixed
PROMPTS = ([[10 + (i % 7) for i in range(n)] for n in (5, 13, 40)]
           + [[20, 21, 22, 23] * 6, [50 + i for i in range(50)]])


@pytest.fixture(scope="module")
def target(tmp_path_factory, default_tokenizer) -> str:
    path = save_tiny_llama3(str(tmp_path_factory.mktemp("spec-tp") / "target"), seed=0)
    default_tokenizer.save_pretrained(path)  # text, so that a stop string can end an output
    return path


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(model: str, params: list[SamplingParams], trace: str | None = None, **kwargs):
    """(outputs as (token ids, text) per prompt and per sample, the scheduler's spec stats)."""
    llm = LLM(model, **ENGINE, trace=trace, **kwargs)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.engine.core.scheduler.spec_stats
    finally:
        llm.engine.shutdown()
    return [[(list(c.token_ids), c.text) for c in o.outputs] for o in outs], stats


def preemptions(trace: str) -> int:
    with open(trace) as f:
        return sum(len(json.loads(line)["preempted"]) for line in f)


@pytest.fixture(scope="module")
def params(target) -> list[SamplingParams]:
    """Greedy requests of several lengths, one with n=2, one with a stop string taken from the
    middle of its own TP=1 output (so that the stop really ends it early)."""
    base = [greedy(24 + 4 * i) for i in range(len(PROMPTS))]
    plain, _ = run(target, base)
    text = plain[2][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    base[1] = greedy(28, n=2)
    base[2] = greedy(36, stop=[stop])
    return base


@pytest.fixture(scope="module")
def reference(target, params):
    want, _ = run(target, params)
    assert len(want[1]) == 2 and want[1][0] == want[1][1]  # greedy: both samples alike
    assert len(want[2][0][0]) < params[2].max_tokens  # the stop string ended it
    return want


PARALLEL = [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]


@pytest.mark.parametrize("parallel", PARALLEL, ids=["tp2", "pp2"])
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    # the target as its own draft: nearly every draft is accepted, so runs of several
    # tokens per step cross the stop string and max_tokens
    "target-as-draft",
])
def test_parallel_with_speculation_equals_one_process_without(target, params, reference, spec,
                                                              parallel, tmp_path):
    if spec == "target-as-draft":
        spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    trace = str(tmp_path / "trace.jsonl")
    got, stats = run(target, params, trace, speculative_config=spec, **parallel)
    assert got == reference
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert preemptions(trace) > 0


@pytest.mark.parametrize("parallel", PARALLEL, ids=["tp2", "pp2"])
def test_parallel_with_a_foreign_draft_model_equals_one_process_without(target, params, reference,
                                                                        parallel, tmp_path):
    # a draft with other weights: most drafts are rejected, so the target's KV slots past
    # each rejection are overwritten on every rank
    draft = save_tiny_llama3(str(tmp_path / "draft"), seed=1)
    got, stats = run(target, params, **parallel, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3,
        "min_acceptance_rate": 0.0})
    assert got == reference
    assert stats.num_draft_tokens > stats.num_accepted_tokens
