"""BlockPool: owns the KV blocks, their reference counts, the free queue and the prefix cache
(full blocks findable by the hash of their contents)."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from kvflow.core.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROOT_HASH = bytes(32)  # the parent of a prompt's first block


def hash_block(parent_hash: bytes | None, token_bytes: bytes, salt: bytes = b"") -> bytes:
    """Chained block hash: sha256 of the parent's hash, the block's token ids (int64,
    little-endian) and the tenant's salt, so that a block's identity is its tokens and
    everything before them. Cryptographic, unlike Python's `hash()` of ints, so that nobody can
    craft a prompt whose block collides with another tenant's; the parent and the ids have a
    fixed length, which keeps the concatenation unambiguous."""
    return hashlib.sha256((parent_hash or ROOT_HASH) + token_bytes + salt).digest()


def hash_token_blocks(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, as the engine's prefix cache (and
    its KV events) name them: what a router that knows a prompt's ids computes to find which
    replica holds its blocks. `salt`: Request.salt_bytes (a `cache_salt`'s UTF-8)."""
    ids = array("q", token_ids[:len(token_ids) // block_size * block_size])
    if sys.byteorder == "big":
        ids.byteswap()
    data, n = ids.tobytes(), 8 * block_size
    hashes: list[bytes] = []
    parent = None
    for i in range(len(ids) // block_size):
        parent = hash_block(parent, data[i * n:(i + 1) * n], salt)
        hashes.append(parent)
    return hashes


class BlockKey(NamedTuple):
    """What a cached block holds, compared on every hit so that even a hash collision can
    never serve another prompt's K/V: the cache id of the block before it (0 for a first
    block), its token ids, and the salt (first blocks only; later ones inherit it): the cache
    salt, or with a LoRA adapter (cache salt, adapter id); and the images it holds."""

    parent_id: int
    token_ids: tuple[int, ...]
    salt: str | tuple[str | None, int] | None
    mm_keys: tuple[str, ...] = ()  # the content hashes of the images in the block


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached
    key: BlockKey | None = None  # with the hash
    cache_id: int = 0  # unique per time the block is cached: a child's key names its parent by it


class BlockPool:
    """Fixed set of `num_blocks` blocks. Free blocks wait in a queue, least recently freed at the
    front; a free block keeps its cached contents until it is handed out again, so eviction is
    least-recently-used and every operation is O(1)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> block
        self._next_cache_id = 1
        self.events: list[KVCacheEvent] | None = None  # a list while KV events are recorded

    def record_events(self) -> None:
        """From now on, append a KV event for every block cached or evicted (kv_events.py)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    evicted.append(block.block_hash)
                block.block_hash = block.key = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(evicted))
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference to cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock], uncached_first: bool = False) -> None:
        """Drop one reference to each block; blocks nobody holds go to the back of the queue.
        Callers pass a request's blocks in reverse so its tail is evicted first.
        `uncached_first`: freed blocks that hold nothing findable go to the front instead, so
        that they are reused before any cached block is evicted (an embedding's blocks)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt went negative"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if uncached_first and block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes, key: BlockKey) -> KVBlock | None:
        """The cached block with this hash, if it also holds exactly `key`."""
        block = self.cached.get(block_hash)
        return block if block is not None and block.key == key else None

    def cache_block(self, block: KVBlock, block_hash: bytes, key: BlockKey,
                    parent_hash: bytes | None = None, lora_id: int | None = None) -> None:
        """Make a full block findable by its hash (the first block with a given hash wins).
        `parent_hash` (the hash of the block before it) and `lora_id` go into its KV event."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash, block.key = block_hash, key
            block.cache_id, self._next_cache_id = self._next_cache_id, self._next_cache_id + 1
            self.cached[block_hash] = block
            if self.events is not None:
                self._stored(block_hash, parent_hash, key.token_ids, lora_id)

    def _stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...],
                lora_id: int | None) -> None:
        """One BlockStored per run of a sequence's blocks cached one after the other (as vLLM
        sends a run at once): a block whose parent ends the last event extends it."""
        last = self.events[-1] if self.events else None
        if (type(last) is BlockStored and parent_hash is not None
                and last.block_hashes[-1] == parent_hash and last.lora_id == lora_id
                and last.block_size == len(token_ids)):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self.events.append(BlockStored([block_hash], parent_hash, list(token_ids),
                                           len(token_ids), lora_id))

    def reset_prefix_cache(self, num_reserved: int = 0) -> bool:
        """Forget every cached block; refused (False) while any block but the `num_reserved`
        held for good (a null block) is in use."""
        if len(self._free) != self.num_blocks - num_reserved:
            return False
        for block in self.blocks:
            block.block_hash = block.key = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free
