"""The KV cache's bookkeeping: one spec per layer kind (spec.py), one manager per spec
(full_attention.py, sliding_window.py, state.py) over one block pool (block_pool.py), and the
coordinator the scheduler asks (coordinator.py). No torch: the tensors live in the runner."""
from kvflow.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock, cdiv, hash_block
from kvflow.core.kv_cache.coordinator import ComputedBlocks, KVCacheCoordinator
from kvflow.core.kv_cache.groups import KVCacheGroup, layer_slots, make_kv_cache_groups
from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec

__all__ = ["BlockKey", "BlockPool", "ComputedBlocks", "FullAttentionSpec", "KVBlock", "KVCacheCoordinator",
           "KVCacheGroup", "KVCacheSpec", "SlidingWindowSpec", "StateSpec", "cdiv", "hash_block",
           "layer_slots", "make_kv_cache_groups"]
