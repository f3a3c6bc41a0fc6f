"""Automatic prefix caching in the core: chained block hashes, LRU eviction, ref counts, salts."""
from __future__ import annotations

import hashlib

import numpy as np

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache import coordinator
from kvflow.core.kv_cache.block_pool import ROOT_HASH, BlockKey, BlockPool, hash_block
from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
from kvflow.core.kv_cache.spec import FullAttentionSpec
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BS = 4


def shared_prefix_request(rid: str, prefix: list[int], suffix_len: int, max_tokens=4, **kw):
    suffix = [900 + (hash(rid) + i) % 50 for i in range(suffix_len)]
    return Request(rid, prefix + suffix, SamplingParams(max_tokens=max_tokens, temperature=0), **kw)


def step(sched, runner):
    out = sched.schedule()
    updates = sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_invariants()
    return out, updates


def test_second_request_computes_only_its_new_tokens():
    prefix = list(range(10, 10 + 10 * BS))  # 10 full blocks
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(shared_prefix_request("A", prefix, 3))
    run_to_completion(sched, runner)
    sched.add_request(shared_prefix_request("B", prefix, 5))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["B"] == 10 * BS
    assert out.num_computed_tokens["B"] == 10 * BS
    assert out.num_scheduled_tokens["B"] == 5
    assert sched.kv_cache_manager.prefix_hits == 10 * BS


def test_output_with_caching_equals_output_without():
    prefix = list(range(10, 10 + 10 * BS))

    def run(caching: bool):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
                          CacheConfig(block_size=BS, num_blocks=64, enable_prefix_caching=caching))
        for i in range(4):
            sched.add_request(shared_prefix_request(f"r{i}", prefix, 3 + i, max_tokens=12))
        outputs, steps = run_to_completion(sched)
        return outputs, sum(s.total_num_scheduled_tokens for s in steps)

    with_cache, work_on = run(True)
    without, work_off = run(False)
    assert with_cache == without
    assert work_on < work_off


def test_never_the_last_prompt_token():
    prompt = list(range(100, 100 + 2 * BS))  # exactly two full blocks
    sched = make_scheduler(num_blocks=32, block_size=BS)
    runner = FakeRunner()
    sched.add_request(Request("A", prompt, SamplingParams(max_tokens=2, temperature=0)))
    run_to_completion(sched, runner)
    sched.add_request(Request("B", prompt, SamplingParams(max_tokens=2, temperature=0)))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["B"] == BS  # the second block holds the last prompt token
    assert out.num_scheduled_tokens["B"] == BS


def _key(h: int) -> BlockKey:  # a stand-in key for pool-level tests
    return BlockKey(0, (h,), None)


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    for blk, h in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(blk, h, _key(h))
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.free_blocks([c])
    # free queue: the never-used block 3, then b, a, c in the order they were freed
    first, second = pool.get_new_blocks(2)
    assert first.block_id == 3 and second is b
    assert pool.lookup(2, _key(2)) is None and pool.lookup(1, _key(1)) is a
    assert pool.lookup(3, _key(3)) is c
    pool.touch([c])  # a hit takes a free cached block out of the queue
    assert pool.get_new_blocks(1)[0] is a
    assert pool.num_free_blocks == 0


def test_shared_blocks_are_ref_counted_and_never_negative():
    prefix = list(range(10, 10 + 6 * BS))
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(shared_prefix_request("A", prefix, 2, max_tokens=20))
    step(sched, runner)
    sched.add_request(shared_prefix_request("B", prefix, 3, max_tokens=20))
    step(sched, runner)
    kv = sched.kv_cache_manager
    shared = set(kv.get_block_ids("A")) & set(kv.get_block_ids("B"))
    assert len(shared) == 6
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in shared)
    sched.abort_request("A")
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in shared)
    run_to_completion(sched, runner)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == 64


def test_cache_salt_keeps_users_apart():
    prefix = list(range(10, 10 + 6 * BS))
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(shared_prefix_request("A", prefix, 2, cache_salt="alice"))
    run_to_completion(sched, runner)
    sched.add_request(shared_prefix_request("B", prefix, 2, cache_salt="bob"))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["B"] == 0
    sched.add_request(shared_prefix_request("C", prefix, 2, cache_salt="alice"))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["C"] == 6 * BS


def test_preempted_request_finds_its_own_blocks_again():
    sched = make_scheduler(num_blocks=12, block_size=BS, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 12, max_tokens=16))
    hits = []
    def on_step(out, _):
        for rid in out.resumed_req_ids:
            hits.append(out.num_cached_tokens[rid])
    outputs, steps = run_to_completion(sched, on_step=on_step)
    assert any(s.preempted_req_ids for s in steps)
    assert hits and max(hits) > 0


def test_reset_prefix_cache_only_when_idle():
    prefix = list(range(10, 10 + 4 * BS))
    sched = make_scheduler(num_blocks=32, block_size=BS)
    runner = FakeRunner()
    sched.add_request(shared_prefix_request("A", prefix, 2, max_tokens=8))
    step(sched, runner)
    assert not sched.reset_prefix_cache()
    run_to_completion(sched, runner)
    assert sched.kv_cache_manager.block_pool.cached
    assert sched.reset_prefix_cache()
    assert not sched.kv_cache_manager.block_pool.cached
    sched.add_request(shared_prefix_request("B", prefix, 2))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["B"] == 0


# -- hashing: a block is found only by what it really holds ------------------------------------

def test_block_hash_is_sha256_of_parent_token_ids_and_salt():
    ids = np.arange(BS, dtype="<i8").tobytes()
    root = hash_block(None, ids)
    assert root == hashlib.sha256(ROOT_HASH + ids).digest()
    assert hash_block(root, ids) == hashlib.sha256(root + ids).digest()
    assert hash_block(None, ids, b"alice") == hashlib.sha256(ROOT_HASH + ids + b"alice").digest()
    assert len({root, hash_block(None, ids, b"alice"), hash_block(root, ids)}) == 3
    # the manager chains them over a request's full blocks (ids as int64, little-endian)
    kv = KVCacheCoordinator([FullAttentionSpec()], num_blocks=8, block_size=BS)
    req = Request("a", list(range(2 * BS + 1)), cache_salt="alice")
    kv.allocate_slots(req, req.num_tokens)
    first = hash_block(None, np.arange(BS, dtype="<i8").tobytes(), b"alice")
    second = hash_block(first, np.arange(BS, 2 * BS, dtype="<i8").tobytes(), b"alice")
    assert kv.req_to_hashes["a"] == [first, second]
    assert [b.block_hash for b in kv.req_to_blocks["a"]] == [first, second, None]


def test_a_forced_hash_collision_is_never_a_hit(monkeypatch):
    # Every block of every prompt gets the same hash: only the tokens can tell them apart.
    monkeypatch.setattr(coordinator, "hash_block", lambda parent, data, salt=b"": b"x" * 32)
    prefix = list(range(10, 10 + 6 * BS))
    sched = make_scheduler(num_blocks=64, block_size=BS, budget=256)
    runner = FakeRunner()
    sched.add_request(shared_prefix_request("A", prefix, 2))
    run_to_completion(sched, runner)
    other = [t + 1000 for t in prefix]
    sched.add_request(shared_prefix_request("B", other, 2))
    out, _ = step(sched, runner)
    assert out.num_cached_tokens["B"] == 0  # same hash, other tokens: a miss
    run_to_completion(sched, runner)
    sched.add_request(shared_prefix_request("C", prefix, 2))
    out, _ = step(sched, runner)
    # A's first block is found; its second collided with the first and was never cached
    assert out.num_cached_tokens["C"] == BS


def test_a_hit_needs_the_same_parent_block_not_just_the_same_hash(monkeypatch):
    # A block's hash depends only on its position: block 1 of every prompt collides.
    monkeypatch.setattr(coordinator, "hash_block",
                        lambda parent, data, salt=b"": hashlib.sha256(parent or ROOT_HASH).digest())
    kv = KVCacheCoordinator([FullAttentionSpec()], num_blocks=8, block_size=BS)
    x0, x1, y0 = [1] * BS, [2] * BS, [3] * BS
    a = Request("a", x0 + x1 + [9])
    kv.allocate_slots(a, a.num_tokens)
    kv.free(a)
    assert kv.get_computed_blocks(Request("a2", x0 + x1 + [9]))[1] == 2 * BS
    # Evict x0 while x1 stays cached (the tail normally goes first; safety must not rely on it).
    x0_block = next(b for b in kv.block_pool.blocks if b.key and b.key.token_ids == tuple(x0))
    kv.block_pool._free.move_to_end(x0_block.block_id, last=False)
    kv.block_pool.free_blocks(kv.block_pool.get_new_blocks(1))
    d = Request("d", y0 + x1 + [9])  # y0 now takes x0's hash; x1's block follows x0, not y0
    assert kv.get_computed_blocks(d)[1] == 0
    kv.allocate_slots(d, d.num_tokens)
    kv.free(d)
    assert kv.get_computed_blocks(Request("e", y0 + x1 + [7]))[1] == BS  # y0 only
    kv.check_invariants()
