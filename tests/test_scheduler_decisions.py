"""What the scheduler records about its decisions in SchedulerOutput (admitted, skipped for
blocks, why admission stopped, preempted for whom, prefill or decode, cached tokens), checked
without a model against what it actually did."""
from __future__ import annotations

import pytest

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion
from kvflow.core.scheduler_output import AdmissionStop, BlockCheck
from kvflow.request import InvalidRequestError, MultiModalFeatureSpec, PlaceholderRange, RequestStatus


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_invariants()
    return out


def run_until_preemption(sched, runner, max_steps=50):
    for _ in range(max_steps):
        out = step(sched, runner)
        if out.preempted_req_ids:
            return out
    pytest.fail("no preemption happened")


# -- admission ---------------------------------------------------------------------------

def test_admitted_requests_are_recorded_with_their_block_check():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    sched.add_request(make_request("A", 10))
    sched.add_request(make_request("B", 5))
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["A", "B"]
    assert out.resumed_req_ids == [] and out.skipped_req_ids == []
    assert out.num_cached_tokens == {"A": 0, "B": 0}
    assert out.block_checks == {"A": BlockCheck(3, 64, 0), "B": BlockCheck(2, 61, 0)}
    assert out.admission_stop is None


def test_a_request_that_lacks_blocks_is_skipped_and_the_next_one_admitted():
    # A's 30-token prompt is chunked 8 tokens a step: 2 blocks now, 6 more promised to it
    sched = make_scheduler(num_blocks=10, block_size=4, budget=64, long_prefill_token_threshold=8)
    for rid, n in (("A", 30), ("B", 20), ("C", 3)):
        sched.add_request(make_request(rid, n, max_tokens=2))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["A", "C"]
    assert out.skipped_req_ids == ["B"]
    assert out.block_checks["B"] == BlockCheck(need=5, free=8, promised=6)  # 5 > 8 - 6
    assert not out.block_checks["B"].fits
    assert out.block_checks["C"] == BlockCheck(need=1, free=8, promised=6)
    assert sched.requests["B"].num_skips == 1 and sched.waiting[0].request_id == "B"


@pytest.mark.parametrize("stop", list(AdmissionStop))
def test_why_admission_stopped_is_recorded(stop):
    config = ({"max_admission_skips": 0} if stop is AdmissionStop.HELD else
              {"max_num_encoder_input_tokens": 4} if stop is AdmissionStop.ENCODER_BUDGET else {})
    sched = make_scheduler(num_blocks={AdmissionStop.PREEMPTION: 6, AdmissionStop.HELD: 10}.get(stop, 64),
                           block_size=4, budget=16 if stop is AdmissionStop.BUDGET else 64,
                           max_num_seqs=1 if stop is AdmissionStop.MAX_NUM_SEQS else 16, **config)
    runner = FakeRunner()
    if stop is AdmissionStop.PREEMPTION:
        sched.add_request(make_request("A", 8, max_tokens=12))
        sched.add_request(make_request("B", 8, max_tokens=12))
        step(sched, runner)
        sched.add_request(make_request("W", 2, max_tokens=2))
        out = run_until_preemption(sched, runner)
        assert "W" in [r.request_id for r in sched.waiting]
    elif stop is AdmissionStop.HELD:
        for rid, n in (("A", 30), ("B", 20), ("C", 3)):
            sched.add_request(make_request(rid, n, max_tokens=2))
        out = sched.schedule()
        assert out.skipped_req_ids == ["B"]  # passed over max_admission_skips (0) times already
        assert "C" not in out.num_scheduled_tokens and "C" not in out.block_checks
    elif stop is AdmissionStop.ENCODER_BUDGET:  # A's image takes the step's encoder budget
        for rid, offset in (("A", 2), ("B", 0)):
            sched.add_request(with_image(make_request(rid, 12), offset, 4))
        out = sched.schedule()
        assert out.scheduled_encoder_inputs == {"A": [0]} and list(out.num_scheduled_tokens) == ["A"]
        assert out.encoder_cuts == {"B": "encoder_budget"}
    else:
        sched.add_request(make_request("A", 20))
        sched.add_request(make_request("B", 4))
        out = sched.schedule()
        assert list(out.num_scheduled_tokens) == ["A"] and "B" not in out.block_checks
    assert out.admission_stop is stop


def with_image(req, offset: int, length: int, identifier: str = "img"):
    """`req` with an image whose placeholder run is [offset, offset + length)."""
    req.mm_features = [MultiModalFeatureSpec("image", identifier, PlaceholderRange(offset, length))]
    return req


def test_image_runs_are_scheduled_whole_within_the_encoder_budget():
    """Chunks stop before an image run the token or encoder budget cannot take whole (the
    request waits for the next step where it could take nothing before it), every run is
    computed in one step with its encoder, and a step encodes at most its encoder budget."""
    sched = make_scheduler(budget=12, max_num_encoder_input_tokens=6)
    sched.add_request(with_image(make_request("A", 9, max_tokens=2), 3, 6, "a"))
    sched.add_request(with_image(make_request("B", 16, max_tokens=2), 1, 5, "b"))
    steps = []
    run_to_completion(sched, on_step=lambda out, updates: steps.append(out))
    first = steps[0]
    # A's whole prompt with its run; the 3 tokens left would end inside B's run: B stops before it
    assert first.num_scheduled_tokens == {"A": 9, "B": 1}
    assert first.scheduled_encoder_inputs == {"A": [0]} and first.num_encoder_tokens == 6
    assert first.encoder_cuts == {"B": "image_run"}
    assert steps[1].scheduled_encoder_inputs == {"B": [0]}
    runs = {"A": (3, 9), "B": (1, 6)}
    encoded = {}
    for out in steps:
        assert out.num_encoder_tokens <= 6
        for rid, n in out.num_scheduled_tokens.items():
            start, (lo, hi) = out.num_computed_tokens[rid], runs[rid]
            overlaps = start < hi and start + n > lo
            assert not overlaps or (start <= lo and start + n >= hi)  # whole, never split
            if overlaps:
                assert out.scheduled_encoder_inputs[rid] == [0]
                encoded[rid] = encoded.get(rid, 0) + 1
    assert encoded == {"A": 1, "B": 1}


def test_an_image_no_step_can_take_whole_is_refused():
    sched = make_scheduler(budget=8)
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        sched.add_request(with_image(make_request("A", 20), 2, 9))
    sched = make_scheduler(budget=16, max_num_encoder_input_tokens=4)
    with pytest.raises(InvalidRequestError, match="encoder budget 4"):
        sched.add_request(with_image(make_request("A", 20), 2, 5))


def test_resumed_request_is_recorded_with_the_prefix_it_finds_cached():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(make_request("A", 8, max_tokens=12))
    sched.add_request(make_request("B", 8, max_tokens=12))
    runner = FakeRunner()
    run_until_preemption(sched, runner)
    for _ in range(50):
        out = step(sched, runner)
        if out.resumed_req_ids:
            break
    assert out.resumed_req_ids == ["B"] and [r.req_id for r in out.scheduled_new_reqs] == ["B"]
    cached = out.num_cached_tokens["B"]
    assert cached > 0 and cached % 4 == 0  # its full blocks stayed in the prefix cache
    assert out.num_computed_tokens["B"] == cached
    assert out.is_prefill["B"]  # recomputing its prompt and outputs


def test_first_scheduled_time_is_set_once_on_the_request():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("A", 8, max_tokens=12), make_request("B", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    assert a.first_scheduled_time is None
    runner = FakeRunner()
    step(sched, runner)
    first = b.first_scheduled_time
    assert first is not None and a.first_scheduled_time is not None
    run_until_preemption(sched, runner)
    assert b.status == RequestStatus.PREEMPTED
    run_to_completion(sched, runner)
    assert b.first_scheduled_time == first  # resuming does not move it
    assert not hasattr(sched, "first_scheduled_time")


# -- preemption --------------------------------------------------------------------------

def test_fcfs_preempts_the_most_recently_admitted_for_the_request_that_needs_a_block():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(make_request("A", 8, max_tokens=12))
    sched.add_request(make_request("B", 8, max_tokens=12))
    out = run_until_preemption(sched, FakeRunner())
    assert out.preempted_req_ids == ["B"] and out.num_preemptions == 1
    assert out.preempted_for == {"B": "A"}  # A needed the block; B was admitted last
    assert out.admission_stop is AdmissionStop.PREEMPTION  # B waits again, not admitted now


@pytest.mark.parametrize("policy, victim", [("fcfs", "B"), ("priority", "A")])
def test_the_preempted_request_follows_the_policy(policy, victim):
    """A (priority 5) is admitted first, B (priority 0) next; B is the first to need a block
    when none is left."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=16, policy=policy)
    runner = FakeRunner()
    sched.add_request(make_request("A", 6, max_tokens=10, priority=5))
    step(sched, runner)
    sched.add_request(make_request("B", 8, max_tokens=10, priority=0))
    out = run_until_preemption(sched, runner)
    assert out.preempted_req_ids == [victim]
    assert out.preempted_for == {victim: "B"}
    survivor = "A" if victim == "B" else "B"
    assert list(out.num_scheduled_tokens) == [survivor]
    assert out.admission_stop is AdmissionStop.PREEMPTION  # the victim waits again


def test_priority_preemption_of_an_already_scheduled_request_takes_back_its_tokens():
    """Under the priority policy the victim may have been scheduled earlier in the same step:
    its tokens leave the plan and the step's counts."""
    sched = make_scheduler(num_blocks=10, block_size=4, budget=64, policy="priority")
    runner = FakeRunner()
    sched.add_request(make_request("B", 8, max_tokens=12, priority=9))
    step(sched, runner)  # B runs first: it comes before A and C in the running order
    for rid, prio, n in (("A", 0, 7), ("C", 1, 6)):
        sched.add_request(make_request(rid, n, max_tokens=12, priority=prio))
    seen = []
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        out = step(sched, runner)
        assert set(out.is_prefill) == set(out.num_scheduled_tokens)
        assert out.num_prefill_tokens + out.num_decode_tokens == out.total_num_scheduled_tokens
        assert not set(out.preempted_req_ids) & set(out.num_scheduled_tokens)
        seen += [(v, r) for v, r in out.preempted_for.items()]
    assert seen == [("B", "A")]  # the lowest priority, though A needed the block


# -- prefill or decode -------------------------------------------------------------------

def test_prefill_is_prompt_tokens_and_decode_one_fed_back_token():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    sched.add_request(make_request("A", 13, max_tokens=3))
    runner = FakeRunner()
    phases = []
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        phases.append((out.num_scheduled_tokens["A"], out.is_prefill["A"]))
        assert out.num_prefill_tokens == (out.total_num_scheduled_tokens if out.is_prefill["A"] else 0)
        assert out.num_decode_tokens == out.total_num_scheduled_tokens - out.num_prefill_tokens
    assert phases == [(8, True), (5, True), (1, False), (1, False)]
