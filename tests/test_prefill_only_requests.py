"""Embedding (pooling) requests and prompt-logprobs requests in the core, without a model:
a pooling request is prefill only, ends with its prompt and leaves nothing in the prefix cache;
a request that reads every prompt position takes no prefix-cache hits, and the scheduler
records why."""
from __future__ import annotations

import pytest

from core_helpers import FakeRunner, make_scheduler
from kvflow.config import ModelConfig, parse_pooler_config
from kvflow.pooling_params import PoolerConfig, PoolingParams
from kvflow.request import FinishReason, Request
from kvflow.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(10, 10 + 6 * BS + 1))  # 6 full blocks and one token


def step(sched, runner):
    out = sched.schedule()
    updates = sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_invariants()
    return out, updates


def pooling(rid, prompt=PROMPT, pooling_type="LAST"):
    return Request(rid, prompt, pooling_params=PoolingParams(pooling_type=pooling_type,
                                                             normalize=True))


def generation(rid, prompt=PROMPT, **kw):
    return Request(rid, prompt, SamplingParams(max_tokens=3, temperature=0, **kw))


def test_pooling_request_ends_with_its_prompt_across_chunks_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=10)
    runner = FakeRunner()
    sched.add_request(pooling("E"))
    steps = []
    while sched.has_unfinished_requests():
        out, updates = step(sched, runner)
        steps.append((out, updates))
    assert [o.num_scheduled_tokens["E"] for o, _ in steps] == [10, 10, 5]  # three prefill chunks
    assert all(o.is_prefill["E"] for o, _ in steps)
    (_, last), = [s for s in steps if s[1]]
    assert last[0].finish_reason == FinishReason.STOP and last[0].new_token_ids == []
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.block_pool.cached == {}, "an embedding's blocks are never findable"


def test_pooling_blocks_are_reused_before_any_cached_block_is_evicted():
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(generation("G"))
    while sched.has_unfinished_requests():
        step(sched, runner)
    pool = sched.kv_cache_manager.block_pool
    cached = set(b.block_id for b in pool.cached.values())
    assert cached
    sched.add_request(pooling("E", [500 + i for i in range(3 * BS)]))
    out, _ = step(sched, runner)
    embedding_blocks = out.block_ids["E"]
    assert not cached & set(embedding_blocks)  # nothing cached was evicted for it
    assert set(b.block_id for b in pool.cached.values()) == cached
    # its freed blocks sit at the front of the free queue: the next request takes them
    sched.add_request(generation("H", [700 + i for i in range(2 * BS)]))
    out, _ = step(sched, runner)
    assert set(out.block_ids["H"]) <= set(embedding_blocks)


@pytest.mark.parametrize("make, reason", [
    (lambda rid: generation(rid, prompt_logprobs=2), "prompt_logprobs"),
    (lambda rid: pooling(rid, pooling_type="MEAN"), "pooling"),
    (lambda rid: pooling(rid, pooling_type="CLS"), "pooling"),
])
def test_a_request_reading_every_prompt_position_takes_no_prefix_cache_hits(make, reason):
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(generation("first"))
    while sched.has_unfinished_requests():
        step(sched, runner)
    sched.add_request(make("again"))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["again"] == 0
    assert out.num_scheduled_tokens["again"] == len(PROMPT)
    assert out.prefix_cache_bypassed == {"again": reason}


def test_prompt_logprobs_request_still_writes_the_cache_and_last_pooling_reads_it():
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(generation("scored", prompt_logprobs=0))
    while sched.has_unfinished_requests():
        step(sched, runner)
    sched.add_request(generation("plain"))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["plain"] == 6 * BS and not out.prefix_cache_bypassed
    while sched.has_unfinished_requests():
        step(sched, runner)
    sched.add_request(pooling("last"))  # LAST reads the last position only: hits are fine
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["last"] == 6 * BS and not out.prefix_cache_bypassed


def test_pooling_request_fits_with_no_room_for_output():
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256, max_model_len=len(PROMPT))
    sched.add_request(pooling("E"))  # a generation request of this length could never run
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(generation("G"))


def test_pooler_config_parses_vllm_keys_and_refuses_others():
    assert parse_pooler_config(None) == PoolerConfig("LAST", True)
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False)
    assert ModelConfig(pooler_config={"pooling_type": "CLS"}).pooler_config.pooling_type == "CLS"
    with pytest.raises(ValueError, match="pooling_type"):
        parse_pooler_config({"pooling_type": "STEP"})
    with pytest.raises(ValueError, match="unknown key.*'softmax'"):
        parse_pooler_config({"softmax": True})
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=64)
    resolved = PoolingParams(normalize=False).resolved(PoolerConfig("MEAN", True))
    assert (resolved.pooling_type, resolved.normalize) == ("MEAN", False)


def test_prompt_logprobs_is_bounded():
    SamplingParams(prompt_logprobs=20)
    for bad in (21, -1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_the_trace_records_the_bypass(tmp_path):
    from kvflow.engine.step_trace import StepTrace
    from kvflow.trace.reader import load_trace
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(generation("first"))
    while sched.has_unfinished_requests():
        step(sched, runner)
    sched.add_request(generation("again", prompt_logprobs=1))
    out = sched.schedule()
    updates = sched.update_from_output(out, runner.execute(out))
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path), 256, BS, 64)
    trace.record(out, updates, 0.0, 0.01, sched.kv_cache_manager.num_free_blocks)
    trace.close()
    (recorded,) = load_trace(str(path)).steps
    assert recorded.prefix_cache_bypassed == {"again": "prompt_logprobs"}


def test_output_processor_keeps_each_prompt_position_once_and_sends_them_with_the_first_token(
        default_tokenizer):
    from kvflow.engine.output_processor import OutputKind, OutputProcessor
    from kvflow.engine.protocol import EngineCoreOutput
    from kvflow.outputs import PromptLogprobsChunk, TokenLogprobs

    def entry(tok):
        return TokenLogprobs(token_ids=[tok, 9], logprobs=[-1.5, -0.5], sampled_rank=2)
    prompt = [10, 11, 12, 13, 14]
    proc = OutputProcessor(default_tokenizer)
    proc.add_request("r", None, prompt, SamplingParams(max_tokens=2, prompt_logprobs=1),
                     OutputKind.DELTA)
    chunk = lambda start, toks: PromptLogprobsChunk(start, [entry(t) for t in toks])  # noqa: E731
    outs, _ = proc.process_outputs([EngineCoreOutput("r", [], prompt_logprobs=chunk(1, [11, 12]))])
    assert outs == []  # nothing to show before the first token
    # preempted mid-prompt: its prompt is computed again from the start
    proc.process_outputs([EngineCoreOutput("r", [], prompt_logprobs=chunk(1, [11, 12, 13]))])
    outs, _ = proc.process_outputs([EngineCoreOutput("r", [7], prompt_logprobs=chunk(4, [14]))])
    (out,) = outs
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert [next(iter(d)) for d in lps[1:]] == prompt[1:]
    assert lps[1][11].rank == 2 and lps[1][9].rank == 1
    outs, _ = proc.process_outputs([EngineCoreOutput("r", [8], finish_reason="length")])
    assert outs[0].prompt_logprobs is None  # a DELTA stream carries them once
