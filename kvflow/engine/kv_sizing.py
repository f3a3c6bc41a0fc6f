"""How many KV blocks fit a memory budget, and the start-up report that says so."""
from __future__ import annotations

import psutil

from kvflow.config import CacheConfig
from kvflow.core.kv_cache.block_pool import cdiv


def num_kv_blocks(cache_config: CacheConfig, kv_bytes_per_token: int) -> int:
    """Blocks that fit `kv_cache_memory`, capped by 90% of the RAM available now."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    budget = min(cache_config.kv_cache_memory, int(psutil.virtual_memory().available * 0.9))
    return max(1, budget // (kv_bytes_per_token * cache_config.block_size))


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    return num_blocks / cdiv(max_model_len, block_size)
