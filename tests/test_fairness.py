"""Fair scheduling: long prompts don't starve short ones; bounded skipping; priorities."""
from __future__ import annotations

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.scheduler import Scheduler


def fair_scheduler(**kw):
    sc = dict(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=8192,
              long_prefill_token_threshold=128)
    sc.update(kw)
    return Scheduler(SchedulerConfig(**sc), CacheConfig(block_size=16, num_blocks=1024))


def first_token_steps(sched):
    first = {}
    def on_step(out, updates):
        for u in updates:
            first.setdefault(u.request.request_id, out.step)
    run_to_completion(sched, on_step=on_step)
    return first


def test_long_prompt_does_not_delay_short_ones():
    sched = fair_scheduler()
    sched.add_request(make_request("long", 4000, max_tokens=4))
    runner = FakeRunner()
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    for i in range(8):
        sched.add_request(make_request(f"s{i}", 40, max_tokens=4))
    first = {}
    def on_step(out, updates):
        assert out.num_scheduled_tokens.get("long", 0) <= 128
        for u in updates:
            first.setdefault(u.request.request_id, out.step)
    run_to_completion(sched, runner, on_step=on_step)
    assert all(first[f"s{i}"] <= 2 for i in range(8)), first
    assert first["long"] > max(first[f"s{i}"] for i in range(8))


def test_without_the_cap_the_long_prompt_takes_the_budget():
    sched = fair_scheduler(long_prefill_token_threshold=0)
    sched.add_request(make_request("long", 4000, max_tokens=4))
    for i in range(8):
        sched.add_request(make_request(f"s{i}", 40, max_tokens=4))
    first = first_token_steps(sched)
    assert min(first[f"s{i}"] for i in range(8)) >= 7  # 4000 / 512 steps of prefill first


def test_blocked_request_is_skipped_a_bounded_number_of_times():
    sched = make_scheduler(num_blocks=18, block_size=4, budget=64, max_num_seqs=8)
    sched.config.max_admission_skips = 3
    runner = FakeRunner()
    sched.add_request(make_request("hog", 40, max_tokens=8))   # up to 12 blocks
    sched.add_request(make_request("big", 40, max_tokens=4))   # its 10 prompt blocks don't fit beside
    admitted = []
    for i in range(30):
        if i < 8:
            sched.add_request(make_request(f"small{i}", 4, max_tokens=2))
        out = sched.schedule()
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        sched.update_from_output(out, runner.execute(out))
        sched.kv_cache_manager.check_invariants()
    assert admitted[0] == "hog"
    before_big = admitted[1:admitted.index("big")]
    assert before_big == ["small0", "small1", "small2"], admitted  # passed over exactly 3 times
    assert not sched.has_unfinished_requests()


def test_priority_policy_serves_lower_value_first():
    sched = make_scheduler(num_blocks=100, max_num_seqs=1, budget=64)
    sched.config.policy = "priority"
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        req = make_request(rid, 8, max_tokens=2)
        req.priority = prio
        sched.add_request(req)
    order = []
    run_to_completion(sched, on_step=lambda out, _: order.extend(r.req_id for r in out.scheduled_new_reqs))
    assert order == ["high", "mid", "low"]


def test_priority_preemption_evicts_the_lowest_priority():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    sched.config.policy = "priority"
    for rid, prio in (("a", 1), ("b", 0)):
        req = make_request(rid, 8, max_tokens=20)
        req.priority = prio
        sched.add_request(req)
    preempted = []
    run_to_completion(sched, on_step=lambda out, _: preempted.extend(out.preempted_req_ids))
    assert preempted and preempted[0] == "a"
