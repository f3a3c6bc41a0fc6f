"""Speculative decoding in the core, without a model: the n-gram proposer, the config's checks,
and the scheduler's bookkeeping of drafts (budget, lookahead slots, rejected positions moved
back and reused, prefix caching, stops inside an accepted run) against a fake greedy model
whose next token is a pure function of the context, so outputs with drafts must equal the
outputs without them whatever is accepted."""
from __future__ import annotations

import numpy as np
import pytest

from core_helpers import FakeRunner, fake_next_token, make_request, make_scheduler, run_to_completion
from kvflow.config import EngineConfig, SpeculativeConfig
from kvflow.core.spec_decode import NgramProposer, SpecDecodeStats, SpecPolicy, ngram_propose
from kvflow.options import engine_config
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


# -- n-gram proposer ------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_match():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 8, 7, 2, 3, 4, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 1..3 (then 9, 8); [2, 3] alone also at 7..8 (then 4):
    # the longest match wins
    got = ngram_propose(np.array(tokens), 2, 5, 3)
    assert got.tolist() == [9, 8, 7]


def test_ngram_prefers_the_latest_of_equally_long_matches():
    tokens = [1, 2, 7, 7, 1, 2, 8, 8, 1, 2]
    assert ngram_propose(np.array(tokens), 2, 4, 2).tolist() == [8, 8]


def test_ngram_proposes_nothing_below_prompt_lookup_min():
    tokens = [4, 5, 6, 1, 9, 9, 1]  # only a 1-token match
    assert ngram_propose(np.array(tokens), 2, 4, 3).tolist() == []
    assert ngram_propose(np.array(tokens), 1, 4, 3).tolist() == [9, 9, 1]


def test_ngram_proposer_follows_a_growing_sequence():
    p = NgramProposer(k=2, min_n=1, max_n=3)
    seq = [1, 2, 3, 1]
    assert p.propose("a", seq) == [2, 3]
    seq += [2, 3, 1, 2]  # grows past the first buffer's use; stays consistent
    assert p.propose("a", seq) == [3, 1]
    p.forget("a")
    assert p.propose("a", [7, 8]) == []


# -- config --------------------------------------------------------------------------------
def test_speculative_config_takes_vllm_keys_as_dict_or_json():
    c = engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    assert c.speculative_config == SpeculativeConfig("ngram", 3, 1, 4)
    c = EngineConfig(speculative_config='{"method": "draft_model", "model": "m", '
                                        '"num_speculative_tokens": 2}')
    assert c.speculative_config.method == "draft_model" and c.speculative_config.model == "m"


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key"),
    ({"method": "ngram", "lookahead": 2}, "'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "model"),
    ("{not json", "JSON"),
    ([1, 2], "JSON object"),
])
def test_speculative_config_refuses_what_it_does_not_know(value, words):
    with pytest.raises(ValueError, match=words):
        engine_config(speculative_config=value)


# -- the policy ----------------------------------------------------------------------------
def test_policy_stops_speculating_on_big_batches_and_poor_acceptance():
    p = SpecPolicy(disable_by_batch_size=4, min_acceptance_rate=0.25, warmup=8)
    assert p.step_allows(3) and not p.step_allows(4)
    assert p.request_allows(4, 0)  # too few drafts to judge
    assert not p.request_allows(40, 5) and p.request_allows(40, 10)


def test_drafts_are_cut_to_stay_within_the_one_call_step_rows():
    p = SpecPolicy(disable_by_batch_size=16, min_acceptance_rate=0.2, one_call_rows=4)
    assert p.step_drafts(1, 4) == 3  # AVX2's 4-row fp32 GEMV: 1 + 3 rows
    assert p.step_drafts(1, 3) == 3 and p.step_drafts(2, 1) == 1  # they fit already
    assert p.step_drafts(2, 4) == 1 and p.step_drafts(3, 4) == 4  # none would fit: k
    p.one_call_rows = 8
    assert [p.step_drafts(n, 4) for n in (1, 2, 3, 4, 5, 8)] == [4, 3, 1, 1, 4, 4]
    p.one_call_rows = 16
    assert [p.step_drafts(n, 4) for n in (1, 3, 4, 5, 6, 8, 9)] == [4, 4, 3, 2, 1, 1, 4]
    p.one_call_rows = 0  # no one-call step (GPU, tensor parallelism): always k
    assert p.step_drafts(1, 16) == 16


def test_stats_count_drafts_and_accepted_per_position():
    s = SpecDecodeStats()
    s.record(4, 2)
    s.record(3, 3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 7, 5)
    assert s.accepted_per_pos == [2, 2, 1, 0]
    assert s.acceptance_rate == pytest.approx(5 / 7) and s.mean_acceptance_length == 3.5


# -- the scheduler with a fake greedy model ------------------------------------------------
class FakeSpecRunner(FakeRunner):
    """FakeRunner that checks drafts the way greedy verification does: accept while the draft
    is the fake model's next token, then add the model's own token."""

    def execute(self, out) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | set(out.preempted_req_ids):
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            assert out.num_computed_tokens[rid] + n - len(drafts) <= len(toks)
            if out.num_computed_tokens[rid] + n - len(drafts) == len(toks):
                new = []
                for d in drafts:
                    t = fake_next_token(toks + new)
                    if t != d:
                        break
                    new.append(d)
                new.append(fake_next_token(toks + new))
                toks.extend(new)
                sampled[rid] = new
        return sampled


def oracle_drafts(sched, step: int, k: int) -> dict[str, list[int]]:
    """The fake model's true next tokens, wrong from a position that varies by step and
    request, so runs of every acceptance length happen."""
    drafts = {}
    for req in sched.running:
        toks, ds = list(req.all_token_ids), []
        wrong_at = (step * 7 + len(req.request_id) + req.num_tokens) % (k + 2)
        for i in range(k):
            t = fake_next_token(toks)
            if i == wrong_at:
                t += 1
            ds.append(t)
            toks.append(t)
        drafts[req.request_id] = ds
    return drafts


def run_with_drafts(sched, k=3, lookahead=0, max_steps=5000):
    sched.num_lookahead_tokens = lookahead
    runner = FakeSpecRunner()
    outputs: dict[str, list[int]] = {}
    finishes = {}
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for rid, d in out.scheduled_spec_decode_tokens.items():
            assert out.num_scheduled_tokens[rid] >= len(d) + 1
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        updates = sched.update_from_output(out, runner.execute(out))
        sched.kv_cache_manager.check_invariants()
        for req in sched.running:  # drafts never sit in the cache's accounting
            assert req.num_computed_tokens <= req.num_tokens
        for u in updates:
            outputs.setdefault(u.request.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                finishes[u.request.request_id] = u.finish_reason
        sched.update_draft_token_ids(oracle_drafts(sched, step, k))
    return outputs, finishes


def mixed_requests():
    # the last one ends exactly at max_model_len 64: its drafts are cut there
    reqs = [make_request(f"r{i}", 4 + 7 * i, max_tokens=min(6 + 4 * i, 60 - 7 * i))
            for i in range(6)]
    # a stop token that the fake model emits inside an accepted run
    probe = make_request("stop", 11, max_tokens=40)
    out, _ = run_to_completion(_single(probe))
    reqs.append(make_request("stop", 11, max_tokens=40, stop_token_ids=[out["stop"][9]]))
    return reqs


def _single(req):
    s = make_scheduler()
    s.add_request(Request(req.request_id, req.prompt_token_ids, req.sampling_params))
    return s


@pytest.mark.parametrize("lookahead", [0, 3])
def test_greedy_outputs_with_drafts_equal_outputs_without(lookahead):
    # small pool and budget: chunked prefill and preemption both happen
    def sched():
        return make_scheduler(num_blocks=18, block_size=4, budget=12, max_model_len=64)
    plain, spec = sched(), sched()
    for r in mixed_requests():
        plain.add_request(r)
    for r in mixed_requests():
        spec.add_request(r)
    want, _ = run_to_completion(plain)
    got, finishes = run_with_drafts(spec, k=3, lookahead=lookahead)
    assert got == want
    assert spec.spec_stats.num_accepted_tokens > 0
    assert spec.spec_stats.num_draft_tokens > spec.spec_stats.num_accepted_tokens  # rejections too
    assert str(finishes["stop"]) == "stop" and len(got["stop"]) == 10
    kv = spec.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks  # nothing leaked


def test_preemption_happens_with_drafts():
    s = make_scheduler(num_blocks=10, block_size=4, budget=16, max_model_len=64)
    for i in range(4):
        s.add_request(make_request(f"p{i}", 6, max_tokens=20))
    preempted = []
    runner = FakeSpecRunner()
    for step in range(400):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        preempted += out.preempted_req_ids
        s.update_from_output(out, runner.execute(out))
        s.kv_cache_manager.check_invariants()
        s.update_draft_token_ids(oracle_drafts(s, step, 4))
    assert preempted and not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 10


def test_drafts_count_against_the_budget_and_rejected_positions_move_back():
    s = make_scheduler(num_blocks=32, block_size=4, budget=6)
    req = make_request("a", 4, max_tokens=20)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {"a": [100]})
    s.update_draft_token_ids({"a": [101, 102, 103, 104, 105, 106, 107]})
    out = s.schedule()
    # 1 known token + as many drafts as the budget of 6 leaves
    assert out.num_scheduled_tokens["a"] == 6
    assert out.scheduled_spec_decode_tokens["a"] == [101, 102, 103, 104, 105]
    assert not out.is_prefill["a"] and out.num_decode_tokens == 6
    assert req.spec_token_ids == []
    # two accepted, then the target's own token
    updates = s.update_from_output(out, {"a": [101, 102, 200]})
    assert updates[0].num_draft_tokens == 5 and updates[0].num_accepted_tokens == 2
    assert req.output_token_ids == [100, 101, 102, 200]
    assert req.num_computed_tokens == req.num_tokens - 1 == 7
    # the slots of the three rejected drafts stay with the request and are written next
    assert len(s.kv_cache_manager.get_block_ids("a")) == 3
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 1 and out.num_computed_tokens["a"] == 7


def test_drafts_are_cut_to_max_tokens_and_max_model_len():
    s = make_scheduler(num_blocks=32, block_size=4, budget=64, max_model_len=12)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 8, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"a": [1], "b": [1]})
    s.update_draft_token_ids({"a": [5, 6, 7, 8], "b": [5, 6, 7, 8]})
    assert a.spec_token_ids == [5]  # 3 - 1 output - 1 for the target's token
    # 4 - 1 - 1; it ends at max_model_len 12, which therefore caps it too
    assert b.spec_token_ids == [5, 6]
    out = s.schedule()
    assert out.num_computed_tokens["b"] + out.num_scheduled_tokens["b"] <= 12


def test_an_unscheduled_mid_prefill_or_constrained_request_gets_no_drafts():
    s = make_scheduler(num_blocks=32, block_size=4, budget=4)
    req = make_request("a", 10, max_tokens=5)
    s.add_request(req)
    out = s.schedule()  # a 4-token chunk of 10
    s.update_from_output(out, {})
    s.update_draft_token_ids({"a": [1, 2]})
    assert req.spec_token_ids == []


def test_prefix_cache_never_finds_a_block_of_rejected_drafts():
    s = make_scheduler(num_blocks=32, block_size=4, budget=64)
    req = Request("a", [10, 11, 12], SamplingParams(max_tokens=10, temperature=0))
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {"a": [13]})
    # drafts that would fill the second block: all rejected
    s.update_draft_token_ids({"a": [50, 51, 52, 53]})
    out = s.schedule()
    s.update_from_output(out, {"a": [14]})
    assert req.all_token_ids == [10, 11, 12, 13, 14]
    # a prompt made of the real first block and the rejected drafts: only block 0 is a hit
    probe = Request("b", [10, 11, 12, 13, 50, 51, 52, 53, 9], SamplingParams(max_tokens=1))
    blocks, num_cached = s.kv_cache_manager.get_computed_blocks(probe)
    assert num_cached == 4


def test_speculator_drafts_only_where_the_policy_allows():
    from kvflow.core.scheduler import RequestUpdate
    from kvflow.core.scheduler_output import SchedulerOutput
    from kvflow.engine.speculator import Speculator

    cfg = SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=3, min_acceptance_rate=0.5)
    spec = Speculator(cfg, NgramProposer(3, 1, 3), 0, "ngram", max_model_len=64)
    reqs = [Request(f"r{i}", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10)) for i in range(3)]
    reqs[1].num_draft_tokens, reqs[1].num_accepted_tokens = 40, 4  # poor acceptance
    updates = [RequestUpdate(r, [2]) for r in reqs]
    got = spec.propose(SchedulerOutput(), updates, 2, lambda rid: [])
    assert got == {"r0": [3, 1, 2], "r2": [3, 1, 2]}
    assert spec.propose(SchedulerOutput(), updates, 3, lambda rid: []) == {}  # batch too big
    reqs[2].output_token_ids = [0] * 8  # 2 tokens left: one draft and the target's token
    assert spec.propose(SchedulerOutput(), updates, 2, lambda rid: [])["r2"] == [3]
    spec.policy.one_call_rows = 3  # one request: 1 + 2 rows in one call
    assert spec.propose(SchedulerOutput(), updates[:1], 1, lambda rid: []) == {"r0": [3, 1]}
