"""KV events in the core: the block pool says which blocks became findable, which were evicted
and when the cache was cleared, in order, with the hashes a consumer computes from token ids."""
from __future__ import annotations

from core_helpers import FakeRunner, run_to_completion
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache.block_pool import hash_token_blocks
from kvflow.core.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvflow.core.scheduler import Scheduler
from kvflow.lora_request import LoRARequest
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BS = 4


def scheduler(num_blocks: int) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
                  CacheConfig(block_size=BS, num_blocks=num_blocks))
    s.kv_cache_manager.record_events()
    return s


def run(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> None:
    s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), **kw))
    run_to_completion(s, FakeRunner())
    s.kv_cache_manager.check_invariants()


def test_no_events_are_recorded_unless_asked():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
                  CacheConfig(block_size=BS, num_blocks=8))
    run(s, "a", list(range(10, 22)))
    assert s.kv_cache_manager.block_pool.events is None
    assert s.kv_cache_manager.take_events() == []


def test_a_prompts_full_blocks_are_stored_as_one_event_with_their_chained_hashes():
    s = scheduler(num_blocks=16)
    prompt = list(range(100, 111))  # 2 full blocks and 3 tokens
    run(s, "a", prompt)
    events = s.kv_cache_manager.take_events()
    assert events == [BlockStored(hash_token_blocks(prompt, BS), None, prompt[:8], BS)]
    assert s.kv_cache_manager.take_events() == []  # drained


def test_a_continuation_names_its_parent_and_a_salt_changes_every_hash():
    s = scheduler(num_blocks=16)
    prompt = list(range(100, 108))
    run(s, "a", prompt)
    (a,) = s.kv_cache_manager.take_events()
    longer = prompt + [7, 8, 9, 10, 11]
    run(s, "b", longer)  # hits the first two blocks, caches the third
    (b,) = s.kv_cache_manager.take_events()
    run(s, "c", prompt + [1], cache_salt="tenant")
    (c,) = s.kv_cache_manager.take_events()
    hashes = hash_token_blocks(longer, BS)
    assert a.block_hashes == hashes[:2]
    assert b == BlockStored(hashes[2:], hashes[1], [7, 8, 9, 10], BS)
    salted = hash_token_blocks(prompt, BS, salt=b"tenant")
    assert c.block_hashes == salted and not set(salted) & set(hashes)


def test_eviction_names_the_evicted_blocks_and_a_reset_clears_all():
    s = scheduler(num_blocks=4)  # room for one 3-block request at a time
    first, second = list(range(100, 109)), list(range(200, 209))
    run(s, "a", first)
    run(s, "b", second)
    stored_a, removed, stored_b = s.kv_cache_manager.take_events()
    assert stored_a.block_hashes == hash_token_blocks(first, BS)
    # a's two cached blocks are taken for b (its uncached tail and the never-cached block first)
    assert type(removed) is BlockRemoved
    assert set(removed.block_hashes) <= set(stored_a.block_hashes) and removed.block_hashes
    assert stored_b.block_hashes == hash_token_blocks(second, BS)
    assert s.reset_prefix_cache()
    assert s.kv_cache_manager.take_events() == [AllBlocksCleared()]


def test_an_adapters_blocks_carry_its_id():
    s = scheduler(num_blocks=16)
    prompt = list(range(100, 109))
    run(s, "a", prompt, lora_request=LoRARequest("sql", 3, "/nowhere"))
    (e,) = s.kv_cache_manager.take_events()
    assert e.lora_id == 3


def test_with_several_groups_each_event_names_its_group_and_the_sequences_own_hashes():
    from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
    from kvflow.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

    kv = KVCacheCoordinator([FullAttentionSpec(), SlidingWindowSpec(sliding_window=4)], 12, BS,
                            max_num_batched_tokens=4)
    kv.record_events()
    prompt = list(range(100, 109))
    req = Request("a", prompt, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(prompt)) is not None
    stored = kv.take_events()
    assert [e.group_idx for e in stored] == [0, 1]
    assert all(e.block_hashes == hash_token_blocks(prompt, BS) for e in stored)
    kv.free(req)
    other = Request("b", list(range(300, 300 + 4 * 8)), SamplingParams(max_tokens=1))
    while other.num_computed_tokens < other.num_tokens:  # in chunks: a window holds 2 blocks
        assert kv.allocate_slots(other, BS) is not None  # 8 + 2 of the 11 blocks: evicts a's
        other.num_computed_tokens += BS
    removed = [e for e in kv.take_events() if type(e) is BlockRemoved]
    assert removed and {e.group_idx for e in removed} <= {0, 1}
    # the sequences' own hashes, no group suffix: a's, and b's own window blocks left behind
    known = set(hash_token_blocks(prompt, BS)) | set(hash_token_blocks(other.prompt_token_ids, BS))
    gone = [h for e in removed for h in e.block_hashes]
    assert set(gone) <= known and set(gone) & set(hash_token_blocks(prompt, BS))
