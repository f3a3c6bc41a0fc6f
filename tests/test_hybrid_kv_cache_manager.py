"""The KV cache of models with sliding windows: layers in equal-sized KV cache groups, one
block table per group from one pool; a sliding group gives back the blocks its window has
passed, admission counts what the window needs, and a prefix-cache hit is cut where a group
no longer holds what the next token reads."""
from __future__ import annotations

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
from kvflow.core.kv_cache.full_attention import FullAttentionManager
from kvflow.core.kv_cache.groups import KVCacheGroup, layer_pages, layer_slots, make_kv_cache_groups
from kvflow.core.kv_cache.spec import SlidingWindowSpec
from kvflow.core.kv_cache.sliding_window import SlidingWindowManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BS, WINDOW = 4, 8
GROUPS = [KVCacheGroup((1,), None), KVCacheGroup((0,), WINDOW)]
SPECS = [g.spec for g in GROUPS]


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _run(kv: KVCacheCoordinator, req: Request, chunk: int) -> None:
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.check_invariants()


def _held(kv: KVCacheCoordinator, g: int, rid: str) -> int:
    return sum(b is not kv.null_block for b in kv.managers[g].req_to_blocks[rid])


def test_groups_have_equal_layer_counts_full_attention_first():
    gemma = [WINDOW if (i + 1) % 6 else None for i in range(18)]  # Gemma 3 270M: 15 local, 3 global
    groups = make_kv_cache_groups(gemma)
    assert [g.sliding_window for g in groups] == [None] + [WINDOW] * 5
    assert all(len(g.layers) == 3 for g in groups)
    assert sorted(i for g in groups for i in g.layers) == list(range(18))
    assert make_kv_cache_groups([None] * 4) == [KVCacheGroup((0, 1, 2, 3), None)]  # as before
    assert [len(g.layers) for g in make_kv_cache_groups([None, 8, 8])] == [1, 1, 1]


def test_model_without_window_keeps_the_plain_manager():
    sched = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=16, block_size=BS))
    kv = sched.kv_cache_manager
    assert [type(m) for m in kv.managers] == [FullAttentionManager] and kv.null_block is None
    sched = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=16, block_size=BS, layer_windows=(8, None)))
    assert [type(m) for m in sched.kv_cache_manager.managers] == [FullAttentionManager, SlidingWindowManager]


def test_sliding_group_returns_blocks_behind_the_window_as_the_request_runs():
    kv = KVCacheCoordinator(SPECS, 64, BS, enable_caching=False, max_num_batched_tokens=8)
    req = _req("a", list(range(100, 140)))
    free_before = kv.num_free_blocks
    _run(kv, req, chunk=8)
    assert _held(kv, 0, "a") == 10  # full attention: every block of 40 tokens
    # the window: the last chunk (positions 32..39) and the 7 keys before its first query
    # span blocks 6..9; blocks 0..5 went back while the prompt advanced
    assert _held(kv, 1, "a") == 4 and len(kv.managers[1].req_to_blocks["a"]) == 10
    assert free_before - kv.num_free_blocks == 14
    for _ in range(9):  # decoding: the window moves on, its old blocks come back
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        assert _held(kv, 1, "a") <= -(-WINDOW // BS) + 1
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == free_before


def test_admission_counts_what_the_window_needs_not_the_whole_prompt():
    kv = KVCacheCoordinator(SPECS, 64, BS, max_num_batched_tokens=8)
    req = _req("a", list(range(400)))
    # full group: 100 blocks; sliding: a window and one step's chunk (7 + 8 tokens: 4 blocks + 1)
    assert kv.num_blocks_needed(req, 400) == 100 + 5


def test_prefix_hit_is_cut_where_a_window_block_was_evicted():
    kv = KVCacheCoordinator(SPECS, 40, BS, max_num_batched_tokens=8)
    prompt = list(range(200, 240))
    a = _req("a", prompt)
    _run(kv, a, chunk=8)
    dropped = 10 - _held(kv, 1, "a")  # sliding blocks given back while it ran (the queue's front)
    kv.free(a)

    hit, n = kv.get_computed_blocks(_req("b", prompt + [1]))
    assert n == 40  # every group still holds what position 40 reads
    assert len(hit.per_group[0]) == 10 and all(b is not kv.null_block for b in hit.per_group[0])
    first = (40 - WINDOW + 1) // BS  # blocks before it are not needed: null entries
    assert all(b is kv.null_block for b in hit.per_group[1][:first])
    assert all(b is not kv.null_block for b in hit.per_group[1][first:])

    # evicting what the window had already left does not cost the hit (the free queue holds
    # the never-used blocks, then those, then the rest of a's in the order freed)
    # (other requests' allocations stand-in: blocks taken from the pool's front)
    pool = kv.block_pool
    taken = pool.get_new_blocks(pool.num_free_blocks - pool.num_cached_free_blocks + dropped)
    assert kv.get_computed_blocks(_req("b", prompt + [1]))[1] == 40
    # evicting the full group's last block cuts its run to 9 blocks; position 36 reads sliding
    # blocks 7 and 8 (still cached); a shorter prefix would need blocks that are gone
    taken += pool.get_new_blocks(1)
    hit, n = kv.get_computed_blocks(_req("b", prompt + [1]))
    assert n == 36
    pool.free_blocks(taken)  # room for b's new blocks
    b = _req("b", prompt + [1])
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, b.num_tokens - n, hit) is not None
    kv.check_invariants()
    kv.free(b)


def test_a_request_that_can_never_fit_the_groups_is_refused_up_front():
    import pytest

    from kvflow.request import InvalidRequestError

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8),
                      CacheConfig(num_blocks=20, block_size=BS, layer_windows=(WINDOW, None)))
    # 40 tokens: 10 blocks of full attention + 4 of the window's; 60 tokens: 15 + 4 > 19
    sched.add_request(_req("fits", list(range(32))))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        sched.add_request(Request("too-long", list(range(52)), SamplingParams(max_tokens=8)))


def test_layers_of_different_shapes_are_different_groups_packed_to_one_page_size():
    """Gemma 4 E2B's 15 cache-owning layers (4 sliding of head 256 then 1 full of head 512, one
    kv head): the full layers are a group of 3 tensors, the sliding ones two groups of 6 layers
    packed two to a tensor page; every layer in exactly one group, each group's spec its shape."""
    windows = ([512] * 4 + [None]) * 3
    shapes = ([(1, 256)] * 4 + [(1, 512)]) * 3
    groups = make_kv_cache_groups(windows, shapes)
    assert [(g.sliding_window, g.head_size, g.pages_per_slot, len(g.layers)) for g in groups] == \
        [(None, 512, 1, 3), (512, 256, 2, 6), (512, 256, 2, 6)]
    assert {g.num_tensors for g in groups} == {3}  # one block: a page of each of 3 tensors
    assert sorted(i for g in groups for i in g.layers) == list(range(15))
    assert groups[1].spec == SlidingWindowSpec(512, num_kv_heads=1, head_size=256)
    assert layer_slots(groups, 15)[1][:4] == [0, 0, 1, 1] and layer_pages(groups, 15)[:4] == [0, 1, 0, 1]


def test_a_page_that_does_not_divide_the_largest_gives_every_layer_the_widest_shape():
    groups = make_kv_cache_groups([8, None, 8, None], [(2, 16), (3, 20)] * 2)  # pages 32 and 60
    assert {(g.num_kv_heads, g.head_size, g.pages_per_slot) for g in groups} == {(3, 20, 1)}
    # one shape everywhere: the groups of windows alone, as before shapes were given
    assert [g.layers for g in make_kv_cache_groups([8, None] * 2, [(2, 16)] * 4)] == \
        [g.layers for g in make_kv_cache_groups([8, None] * 2)]
