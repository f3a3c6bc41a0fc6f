"""The scheduler's contract (DESIGN.md), checked without a model."""
from __future__ import annotations

import pytest

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion
from kvflow.request import FinishReason, InvalidRequestError, Request, RequestStatus, check_request_fits
from kvflow.sampling_params import SamplingParams


def test_decode_goes_before_prefill():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("A", 6))
    runner = FakeRunner()
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))  # A's prompt done, first token sampled
    sched.add_request(make_request("B", 40))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["A", "B"]
    assert out.num_scheduled_tokens == {"A": 1, "B": 15}


def test_long_prompt_is_split_by_the_budget_with_varying_chunks():
    sched = make_scheduler(budget=16, num_blocks=128)
    sched.add_request(make_request("A", 5, max_tokens=20))
    sched.add_request(make_request("B", 50, max_tokens=2))
    chunks = []
    def record(out, _):
        if "B" in out.num_scheduled_tokens and out.num_computed_tokens["B"] < 50:
            chunks.append(out.num_scheduled_tokens["B"])
        assert out.total_num_scheduled_tokens <= 16
    outputs, _ = run_to_completion(sched, on_step=record)
    assert sum(chunks) == 50
    assert len(set(chunks)) > 1, chunks  # 11 in the first step (A's prompt took 5), then 15s
    assert chunks[0] == 11 and chunks[1] == 15
    assert len(outputs["B"]) == 2


def test_request_arriving_mid_run_joins_the_next_step():
    sched = make_scheduler()
    sched.add_request(make_request("A", 4, max_tokens=10))
    runner = FakeRunner()
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("B", 4, max_tokens=3))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"A", "B"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["B"]


def test_finished_request_returns_its_blocks_in_the_same_step():
    sched = make_scheduler(num_blocks=16, block_size=4)
    sched.add_request(make_request("A", 7, max_tokens=2))
    runner = FakeRunner()
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.kv_cache_manager.num_free_blocks == 14
    out = sched.schedule()
    updates = sched.update_from_output(out, runner.execute(out))
    assert updates[0].finish_reason == FinishReason.LENGTH
    assert sched.kv_cache_manager.num_free_blocks == 16
    assert "A" in sched.schedule().finished_req_ids


def test_admission_waits_until_the_whole_prompt_fits():
    sched = make_scheduler(num_blocks=10, block_size=4, budget=8)
    sched.add_request(make_request("A", 20, max_tokens=4))   # 5 blocks for the prompt
    sched.add_request(make_request("B", 24, max_tokens=4))   # 6 blocks: does not fit beside A
    runner = FakeRunner()
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["A"]
    assert [r.request_id for r in sched.waiting] == ["B"]
    sched.update_from_output(out, runner.execute(out))
    outputs, steps = run_to_completion(sched, runner)
    assert len(outputs["A"]) == 4 and len(outputs["B"]) == 4
    assert all(not s.preempted_req_ids for s in steps)


def test_preemption_when_blocks_run_out_gives_the_same_output():
    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", 10 + i, max_tokens=30))
        outputs, steps = run_to_completion(sched)
        return outputs, [rid for s in steps for rid in s.preempted_req_ids]

    reference, none = run(num_blocks=200)
    assert none == []
    outputs, preempted = run(num_blocks=16)
    assert preempted, "the small pool should force a preemption"
    assert preempted[0] == "r3"  # the most recently admitted goes first
    assert outputs == reference


def test_preempted_request_goes_back_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(make_request("A", 8, max_tokens=12))
    sched.add_request(make_request("B", 8, max_tokens=12))
    runner = FakeRunner()
    for _ in range(20):
        out = sched.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == ["B"]
            assert sched.waiting[0].request_id == "B"
            assert sched.requests["B"].status == RequestStatus.PREEMPTED
            assert sched.requests["B"].num_computed_tokens == 0
            return
        sched.update_from_output(out, runner.execute(out))
    pytest.fail("no preemption happened")


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=3, num_blocks=100)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4))
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == 3


def test_invariants_hold_under_random_load():
    import random
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=40, block_size=4, budget=24, max_num_seqs=8)
    runner = FakeRunner()
    expected = {}
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            rid = f"q{step}"
            req = make_request(rid, rng.randint(1, 40), max_tokens=rng.randint(1, 20))
            expected[rid] = req.max_tokens
            sched.add_request(req)
        if step % 37 == 0 and sched.running:
            victim = rng.choice(sched.running).request_id
            sched.abort_request(victim)
            expected.pop(victim)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 24
        for rid, n in out.num_scheduled_tokens.items():
            assert out.num_computed_tokens[rid] + n <= sched.requests[rid].num_tokens
        sampled = runner.execute(out)
        for u in sched.update_from_output(out, sampled):
            if u.finish_reason:
                assert u.request.num_output_tokens == expected.pop(u.request.request_id)
        sched.kv_cache_manager.check_invariants()
    assert not sched.has_unfinished_requests() and not expected
    assert sched.kv_cache_manager.num_free_blocks == 40


def test_request_that_can_never_fit_is_refused():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match="60 tokens.*max_tokens is 10.*max_model_len 64"):
        sched.add_request(make_request("A", 60, max_tokens=10))


def test_abort_frees_blocks_now():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("A", 9))
    out = sched.schedule()
    sched.update_from_output(out, FakeRunner().execute(out))
    assert sched.kv_cache_manager.num_free_blocks < 16
    assert sched.abort_request("A")
    assert sched.kv_cache_manager.num_free_blocks == 16
    assert "A" in sched.schedule().finished_req_ids


def test_stop_token_and_eos_respect_min_tokens():
    from core_helpers import fake_next_token
    sched = make_scheduler()
    req = make_request("A", 4, max_tokens=10)
    first = fake_next_token(req.all_token_ids)
    req.eos_token_ids = (first,)
    sched.add_request(req)
    outputs, _ = run_to_completion(sched)
    assert outputs["A"] == [first]
    assert req.finish_reason == FinishReason.STOP

    sched = make_scheduler()
    req = make_request("B", 4, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    sched.add_request(req)
    outputs, _ = run_to_completion(sched)
    assert len(outputs["B"]) >= 3


def test_every_eos_id_stops_a_request_and_ignore_eos_ignores_them_all():
    from core_helpers import fake_next_token
    for where in (0, 1):  # the id that comes up first in the list, or last
        sched = make_scheduler()
        req = make_request("A", 4, max_tokens=10)
        first = fake_next_token(req.all_token_ids)
        req.eos_token_ids = (first, 7) if where == 0 else (7, first)
        sched.add_request(req)
        outputs, _ = run_to_completion(sched)
        assert outputs["A"] == [first] and req.finish_reason == FinishReason.STOP
    sched = make_scheduler()
    req = make_request("B", 4, max_tokens=10, ignore_eos=True)
    req.eos_token_ids = (fake_next_token(req.all_token_ids), 7)
    sched.add_request(req)
    outputs, _ = run_to_completion(sched)
    assert len(outputs["B"]) == 10 and req.finish_reason == FinishReason.LENGTH


def test_a_request_takes_one_eos_id_or_several():
    from kvflow.request import Request
    assert Request("a", [1], eos_token_id=2).eos_token_ids == (2,)
    assert Request("a", [1], eos_token_id=[2, 3]).eos_token_ids == (2, 3)
    assert Request("a", [1]).eos_token_ids == ()


# -- the one check of a request's size ----------------------------------------------------

def test_check_request_fits_names_the_numbers_and_the_field():
    assert check_request_fits(10, 6, 16) == 6
    assert check_request_fits(10, None, 16) == 6  # as many as fit
    cases = [((0, 4, 16), "prompt", "prompt must not be empty"),
             ((16, None, 16), "prompt", "prompt has 16 tokens; max_model_len is 16"),
             ((10, 7, 16), "max_tokens", "prompt has 10 tokens and max_tokens is 7: 17 is over "
                                         "max_model_len 16"),
             ((10, 6, 16, 4, 3), "max_tokens", "prompt and max_tokens need 16 tokens (4 KV blocks) "
                                               "but the KV cache holds only 3 blocks")]
    for args, param, message in cases:
        with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
            check_request_fits(*args)
        assert e.value.param == param and isinstance(e.value, ValueError)


def test_the_scheduler_refuses_what_can_never_fit_with_the_same_check():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="holds only 3 blocks"):
        sched.add_request(Request("A", [5] * 10, SamplingParams(max_tokens=6)))
    assert not sched.has_unfinished_requests()
