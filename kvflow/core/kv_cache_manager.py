"""KVCacheManager: which blocks each request holds; allocate_slots is all-or-nothing; with
prefix caching, a new request starts from the longest run of cached full blocks of its prompt."""
from __future__ import annotations

import hashlib
import sys
from array import array

from kvflow.core.block_pool import BlockKey, BlockPool, KVBlock
from kvflow.request import Request


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` still lacks to hold `num_tokens` positions."""
        held = len(self.req_to_blocks.get(req.request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        """Hashes of the first `num_full_blocks` blocks of `req`'s tokens, computed once each:
        one conversion of the new blocks' ids to bytes, one sha256 per block."""
        hashes = self.req_to_hashes.setdefault(req.request_id, [])
        start = len(hashes)
        if num_full_blocks <= start:
            return hashes
        bs, n = self.block_size, 8 * self.block_size
        ids = array("q", req.all_token_ids[start * bs:num_full_blocks * bs])
        if sys.byteorder == "big":
            ids.byteswap()  # the hash of a prompt is the same on every machine
        data = ids.tobytes()
        salt = req.salt_bytes
        parent = hashes[-1] if hashes else None
        for i in range(num_full_blocks - start):
            parent = hash_block(parent, data[i * n:(i + 1) * n], salt)
            hashes.append(parent)
        return hashes

    def _block_key(self, req: Request, i: int, parent: KVBlock | None) -> BlockKey:
        """What a hit must match besides the hash: the block's own tokens, the exact cached
        block before it (its cache id) and, for a first block, the salt."""
        bs = self.block_size
        return BlockKey(parent.cache_id if parent is not None else 0,
                        tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
                        req.block_salt if parent is None else None)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of `req`'s tokens, never covering
        the last token (it must be computed to sample). Changes nothing."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for i, h in enumerate(self._block_hashes(req, max_blocks)):
            parent = blocks[-1] if blocks else None
            block = self.block_pool.lookup(h, self._block_key(req, i, parent))
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        """How many of these cached blocks sit in the free queue (taking them uses free room)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None,
                       cache: bool = True,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Reserve room for `num_computed_tokens + num_new_tokens` positions (after taking
        `computed_blocks`, the prefix-cache hit found at admission), plus
        `num_lookahead_tokens` more (a draft model's steps write there). Returns the ids of the
        newly allocated blocks (possibly none), or None, changing nothing, if they don't fit.
        Only positions of `req`'s real tokens are ever cached: never a draft's.
        `cache=False`: the new blocks are filled by something that may fail (a KV pull), so they
        become findable only through `cache_blocks` once they are."""
        computed_blocks = computed_blocks or []
        held = len(self.req_to_blocks.get(req.request_id, ())) + len(computed_blocks)
        end = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = max(0, cdiv(end, self.block_size) - held)
        if need + self.num_evictable(computed_blocks) > self.block_pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.num_cached_blocks[req.request_id] = len(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(need)
        blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(req, blocks, req.num_computed_tokens + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Make `req`'s full blocks up to `num_tokens` findable (their K/V are in place)."""
        if self.enable_caching:
            self._cache_full_blocks(req, self.req_to_blocks.get(req.request_id, []), num_tokens)

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks that this step fills get findable now: their K/V are written in this step's
        # forward, before any later step can read them.
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(start, num_full):
            parent = blocks[i - 1] if i else None
            if parent is not None and parent.block_hash is None:
                break  # its parent is not findable (another block won its hash): nor is it
            self.block_pool.cache_block(blocks[i], hashes[i], self._block_key(req, i, parent))
        self.num_cached_blocks[req.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks to the pool (its last block first, so the tail is
        evicted before the shared prefix)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        # an embedding's blocks are never cached: reused first, evicting nobody's prefix
        self.block_pool.free_blocks(list(reversed(blocks)), uncached_first=req.is_pooling)

    def free_request_id(self, request_id: str) -> None:
        """`free` for blocks held under an id whose request is gone (a lent prompt's)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def forget(self, req: Request) -> None:
        """Drop per-request hash memo once the request is gone for good."""
        self.req_to_hashes.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Ref counts equal holders and are >= 0, a request never holds a block twice,
        free + used = total."""
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "a request holds a block twice"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt"
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders.get(block.block_id, 0)}")
            assert (block.ref_cnt == 0) == self.block_pool.is_free(block.block_id)
        shared = [i for i, n in holders.items() if n > 1]
        assert all(self.block_pool.blocks[i].block_hash is not None for i in shared), (
            "only cached (full, hashed) blocks may be shared")
        assert self.num_free_blocks + len(holders) == self.num_total_blocks
