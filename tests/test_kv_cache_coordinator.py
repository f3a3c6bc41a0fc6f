"""The KV cache coordinator and its specs: one manager per KV cache group behind the one object
the scheduler asks; a state group (StateSpec) holds one slot per running request, taken at
admission and given back on finish, abort and preemption, and with prefix caching snapshots at
block boundaries that later hits resume from. Model-free, milliseconds."""
from __future__ import annotations

import pytest

from core_helpers import FakeRunner, make_request, run_to_completion
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
from kvflow.core.kv_cache.groups import KVCacheGroup
from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BS = 4
STATE = StateSpec(bytes_per_request=4096)


def _sched(num_slots: int, num_blocks: int = 64, budget: int = 32, specs=None, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256, **kw),
                     CacheConfig(block_size=BS, num_blocks=num_blocks),
                     kv_cache_specs=specs or [FullAttentionSpec(), STATE], num_state_slots=num_slots)


def _slots(sched: Scheduler) -> dict[str, int]:
    return sched.kv_cache_manager.managers[-1].req_to_slot


def _step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_invariants()
    return out


def test_specs_are_plain_values_checked_once():
    assert FullAttentionSpec() == FullAttentionSpec()
    assert SlidingWindowSpec(8) == SlidingWindowSpec(8) != SlidingWindowSpec(16)
    assert KVCacheGroup((0, 1), None).spec == FullAttentionSpec()
    assert KVCacheGroup((2,), 8).spec == SlidingWindowSpec(8)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(0)
    with pytest.raises(ValueError, match="bytes_per_request"):
        StateSpec(0)


def test_group_zero_must_be_attention_and_every_spec_needs_a_manager():
    with pytest.raises(ValueError, match="group 0"):
        KVCacheCoordinator([STATE, FullAttentionSpec()], 16, BS, num_state_slots=2)
    with pytest.raises(ValueError, match="state slot"):
        KVCacheCoordinator([FullAttentionSpec(), STATE], 16, BS, num_state_slots=0)
    with pytest.raises(ValueError, match="no KV cache manager"):
        KVCacheCoordinator([KVCacheSpec()], 16, BS)


def test_a_model_without_windows_is_one_table_without_a_null_block():
    kv = KVCacheCoordinator([FullAttentionSpec()], 16, BS)
    assert kv.num_groups == 1 and kv.null_block is None and kv.num_total_blocks == 16
    req = Request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]  # the pool's first blocks, in order
    assert kv.get_group_block_ids("a") == ([0, 1, 2],)
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_state_slot_allocated_on_admission():
    sched = _sched(num_slots=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", 10))
    assert _slots(sched) == {}  # waiting: nothing held yet
    out = _step(sched, runner)
    assert _slots(sched) == {"a": 0}
    assert out.group_block_ids["a"] == (out.block_ids["a"], [0])  # the slot is its state table


def test_state_layers_take_no_blocks():
    kv = KVCacheCoordinator([FullAttentionSpec(), STATE], 16, BS, num_state_slots=2)
    req = Request("a", list(range(10)))
    assert kv.num_blocks_needed(req, 10) == 3 and kv.max_blocks_needed(10) == 3
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert kv.num_free_blocks == 13 and kv.managers[1].num_free_slots == 1


def test_admission_is_refused_when_no_state_slot_is_free():
    sched = _sched(num_slots=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", 8, max_tokens=3))
    sched.add_request(make_request("b", 8, max_tokens=3))
    out = _step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["a"]  # blocks and budget would admit both
    assert "b" in out.skipped_req_ids and not out.block_checks["b"].fits
    assert not out.block_checks["b"].state_slot
    while "b" not in _slots(sched):
        _step(sched, runner)
    assert _slots(sched) == {"b": 0}  # a finished: its slot went to b


def test_allocate_slots_changes_nothing_without_a_free_state_slot():
    kv = KVCacheCoordinator([FullAttentionSpec(), STATE], 16, BS, num_state_slots=1)
    a, b = Request("a", list(range(8))), Request("b", list(range(100, 108)))
    assert kv.allocate_slots(a, 8) is not None
    free = kv.num_free_blocks
    assert not kv.has_room(b)
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == free and "b" not in kv.req_to_blocks
    assert kv.allocate_slots(a, 1) is not None  # a running request keeps its slot
    kv.check_invariants()


def test_state_slot_freed_on_finish():
    sched = _sched(num_slots=2)
    sched.add_request(make_request("a", 6, max_tokens=4))
    sched.add_request(make_request("b", 9, max_tokens=2))
    run_to_completion(sched)
    assert _slots(sched) == {} and sched.kv_cache_manager.managers[1].num_free_slots == 2
    sched.kv_cache_manager.check_invariants()


def test_state_slot_freed_on_abort():
    sched = _sched(num_slots=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", 6, max_tokens=20))
    sched.add_request(make_request("b", 6, max_tokens=20))
    _step(sched, runner)
    assert _slots(sched) == {"a": 0, "b": 1}
    sched.abort_request("a")
    assert _slots(sched) == {"b": 1}
    sched.add_request(make_request("c", 6, max_tokens=20))
    _step(sched, runner)
    assert _slots(sched) == {"b": 1, "c": 0}


def test_state_slot_freed_on_preemption():
    sched = _sched(num_slots=3, num_blocks=12, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 12, max_tokens=16))
    preempted = []

    def on_step(out, _):
        sched.kv_cache_manager.check_invariants()
        for rid in out.preempted_req_ids:
            assert rid not in _slots(sched)  # it recomputes its state when resumed
            preempted.append(rid)
        assert set(_slots(sched)) == {r.request_id for r in sched.running}

    run_to_completion(sched, on_step=on_step)
    assert preempted
    assert _slots(sched) == {}


def _finish(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=2, temperature=0)))
    runner = FakeRunner()
    while sched.has_unfinished_requests():
        _step(sched, runner)


def test_a_state_model_hits_where_a_snapshot_was_kept_and_resumes_from_it():
    """Each step keeps the state at the last block boundary it crosses: with an 8-token budget
    a's chunks end at 8, 16, 24 (and 25), so prompts sharing 6 or 5 of its blocks resume at 24
    and 16, the restore copying the snapshot into the new request's slot before its step."""
    sched = _sched(num_slots=4, budget=8)
    prompt = list(range(10, 10 + 6 * BS))
    _finish(sched, "a", prompt + [1])
    state = sched.kv_cache_manager.managers[-1]
    assert len(state.snapshots) == 3 and state.num_snapshots == 4  # at 8, 16 and 24
    sched.add_request(Request("b", prompt + [2], SamplingParams(max_tokens=2, temperature=0)))
    out = sched.schedule()
    assert out.num_cached_tokens["b"] == 6 * BS
    [(snap, slot)] = out.state_restores
    assert slot == _slots(sched)["b"] and snap >= state.num_slots
    runner = FakeRunner()
    sched.update_from_output(out, runner.execute(out))
    while sched.has_unfinished_requests():
        _step(sched, runner)
    sched.add_request(Request("c", prompt[:5 * BS] + [99] * 5, SamplingParams(max_tokens=2, temperature=0)))
    assert sched.schedule().num_cached_tokens["c"] == 4 * BS  # the snapshot at 16, not at 20
    sched.kv_cache_manager.check_invariants()


def test_a_snapshot_is_found_only_once_its_step_has_run():
    """Two requests sharing a prefix admitted in one step: the second finds the first's blocks
    but not its state (written by that very step), so it computes its prompt whole."""
    sched = _sched(num_slots=2, budget=64)
    prompt = list(range(10, 10 + 6 * BS))
    for rid, last in (("a", 1), ("b", 2)):
        sched.add_request(Request(rid, prompt + [last], SamplingParams(max_tokens=2, temperature=0)))
    out = sched.schedule()
    assert out.num_cached_tokens == {"a": 0, "b": 0} and len(out.state_saves) == 2
    assert not out.state_restores


def test_a_state_whose_layers_keep_no_snapshots_never_hits():
    """StateSpec(snapshots=False): layers that cannot copy their state (the engine's spec for a
    model without copy_states) give no hit, however many blocks are cached."""
    sched = _sched(num_slots=2, budget=8, specs=[FullAttentionSpec(), StateSpec(4096, snapshots=False)])
    prompt = list(range(10, 10 + 6 * BS))
    _finish(sched, "a", prompt + [1])
    sched.add_request(Request("b", prompt + [2], SamplingParams(max_tokens=2, temperature=0)))
    out = sched.schedule()
    assert out.num_cached_tokens["b"] == 0 and not out.state_saves


def test_without_prefix_caching_no_snapshot_is_kept():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=256),
                      CacheConfig(block_size=BS, num_blocks=64, enable_prefix_caching=False),
                      kv_cache_specs=[FullAttentionSpec(), STATE], num_state_slots=2)
    runner = FakeRunner()
    sched.add_request(Request("a", list(range(10, 35)), SamplingParams(max_tokens=2, temperature=0)))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.state_saves and not out.state_restores
        sched.update_from_output(out, runner.execute(out))
    assert sched.kv_cache_manager.managers[-1].num_snapshots == 0


def test_each_group_lists_its_table_and_windows_share_one_pool():
    specs = [FullAttentionSpec(), SlidingWindowSpec(8), STATE]
    kv = KVCacheCoordinator(specs, 32, BS, max_num_batched_tokens=8, num_state_slots=4)
    assert kv.null_block is not None and kv.num_total_blocks == 31
    req = Request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) == [1, 2, 3]  # block 0 is the null block
    full, window, state = kv.get_group_block_ids("a")
    assert full == [1, 2, 3] and window == [4, 5, 6] and state == [0]
    kv.check_invariants()


def test_reset_prefix_cache_with_windows_when_idle():
    kv = KVCacheCoordinator([FullAttentionSpec(), SlidingWindowSpec(8)], 32, BS)
    req = Request("a", list(range(12)))
    kv.allocate_slots(req, 12)
    assert kv.block_pool.cached and not kv.reset_prefix_cache()  # a request holds blocks
    kv.free(req)
    assert kv.reset_prefix_cache() and not kv.block_pool.cached  # the null block does not count


def test_a_lent_prompt_returns_every_group_s_blocks():
    kv = KVCacheCoordinator([FullAttentionSpec(), SlidingWindowSpec(8), STATE], 32, BS,
                            num_state_slots=2)
    req = Request("a", list(range(12)))
    kv.allocate_slots(req, 12)
    kv.free_request_id("a")  # its request is gone; the id held the blocks under a lease
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_total_blocks and kv.managers[2].num_free_slots == 2
