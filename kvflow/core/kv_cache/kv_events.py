"""What the prefix cache tells the world: a full block became findable (BlockStored), cached
blocks were evicted (BlockRemoved), or the whole cache was dropped (AllBlocksCleared).

vLLM's KV events, as plain records: the block pool appends them as it caches and evicts, the
engine drains them once a step and publishes them (kvflow/engine/kv_events.py), and a router
that subscribes knows which blocks each replica still holds. A block's hash is the chained
sha256 of kvflow/core/kv_cache/block_pool.py's `hash_block`, so anyone holding the token ids can
compute it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence became findable: their hashes in order, the hash
    of the block before the first (None for a prompt's first block), all their token ids, and
    the adapter (LoRA int id) they were computed under. `group_idx`: the KV cache group (None
    when the model has one)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their slots taken for other tokens)."""

    block_hashes: list[bytes] = field(default_factory=list)
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no block is findable any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
