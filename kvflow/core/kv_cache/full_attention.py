"""FullAttentionManager: the block table of one KV cache group whose layers attend to the whole
context. A request holds one block per `block_size` positions until it ends; with prefix
caching, its full blocks become findable by their chained hash and a new request starts from
the longest run of them at the start of its prompt.

The coordinator hashes a request's blocks once for all groups and hands each manager the
hashes; a manager only looks blocks up, takes them and gives them back."""
from __future__ import annotations

from kvflow.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock, cdiv
from kvflow.request import Request


class FullAttentionManager:
    """One group's block tables (request id -> blocks) over the shared pool. `hash_suffix`
    keeps each group's copy of a block its own cache entry (empty with a single group);
    `null_block` stands in a table for a block that is never read (sliding windows only)."""

    def __init__(self, block_pool: BlockPool, block_size: int, hash_suffix: bytes = b"",
                 null_block: KVBlock | None = None) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.hash_suffix = hash_suffix
        self.null_block = null_block
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached

    # -- what a request needs --------------------------------------------------------------
    def first_needed_block(self, num_computed: int) -> int:
        """The first block the next token (at position num_computed) still reads."""
        return 0

    def blocks_wanted(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` positions holds at once."""
        return cdiv(num_tokens, self.block_size)

    def num_real_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still lacks to run up to `num_tokens` positions."""
        return max(0, self.blocks_wanted(num_tokens) - self.num_real_blocks(request_id))

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit: int) -> int:
        """Blocks to take now so that its table (after `num_hit` prefix-cache entries) covers
        `num_tokens` positions."""
        held = len(self.req_to_blocks.get(request_id, ())) + num_hit
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def has_room(self, request_id: str) -> bool:
        """Whether anything but blocks stops the request (blocks are counted by the caller)."""
        return True

    def remove_skipped_blocks(self, req: Request) -> None:
        """Give back blocks the request will never read again: none, for full attention."""

    # -- prefix caching --------------------------------------------------------------------
    def block_key(self, req: Request, i: int, parent: KVBlock | None) -> BlockKey:
        """What a hit must match besides the hash: the block's own tokens, the exact cached
        block before it (its cache id) and, for a first block, the salt."""
        bs = self.block_size
        return BlockKey(parent.cache_id if parent is not None else 0,
                        tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
                        req.block_salt if parent is None else None,
                        req.block_mm_keys(i, bs) if req.mm_features else ())

    def _parent(self, table: list[KVBlock], i: int) -> KVBlock | None:
        return table[i - 1] if i else None

    def find_cached(self, req: Request, hashes: list[bytes], n: int) -> list[KVBlock | None]:
        """This group's cached block for each of the first n blocks (None where it has none);
        the run stops at the first miss (each block's key names its parent)."""
        found: list[KVBlock | None] = []
        for i in range(n):
            parent = found[-1] if found else None
            block = self.block_pool.lookup(hashes[i] + self.hash_suffix, self.block_key(req, i, parent))
            if block is None:
                break
            found.append(block)
        return found + [None] * (n - len(found))

    def cut(self, found: list[KVBlock | None], n: int) -> int:
        """The hit of n blocks, shortened where this group lacks what position n * block_size
        reads: a full group's run ends at its first miss."""
        misses = [i for i in range(self.first_needed_block(n * self.block_size), n) if found[i] is None]
        return misses[0] if misses else n

    def hit_table(self, found: list[KVBlock | None], n: int) -> list[KVBlock]:
        """The leading table a hit of n blocks gives (null entries where a window moved on)."""
        first = self.first_needed_block(n * self.block_size)
        return [self.null_block] * first + found[first:n]

    def cache_blocks(self, req: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Make the request's full blocks up to `num_tokens` findable (their K/V are in place,
        or written by this step's forward, before any later step can read them)."""
        rid = req.request_id
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        table = self.req_to_blocks.get(rid, [])
        for i in range(start, num_full):
            block, parent = table[i], self._parent(table, i)
            if block is self.null_block or (parent is not None and parent.block_hash is None):
                break  # its parent is not findable (another block won its hash): nor is it
            self.block_pool.cache_block(block, hashes[i] + self.hash_suffix,
                                        self.block_key(req, i, parent),
                                        hashes[i - 1] + self.hash_suffix if i else None,
                                        req.lora_int_id or None)
        self.num_cached_blocks[rid] = num_full

    # -- taking and giving back ------------------------------------------------------------
    def take(self, req: Request, hit: list[KVBlock], num_new: int) -> list[KVBlock]:
        """Append a prefix-cache hit's table (already touched by the caller) and `num_new` new
        blocks to the request's table; returns the new blocks."""
        table = self.req_to_blocks.setdefault(req.request_id, [])
        if hit:
            table.extend(hit)
            self.num_cached_blocks[req.request_id] = len(hit)
        new = self.block_pool.get_new_blocks(num_new)
        table.extend(new)
        return new

    def free(self, request_id: str, uncached_first: bool = False) -> None:
        """Return the request's blocks to the pool, its last block first (its tail is evicted
        before the shared prefix)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block],
                                    uncached_first=uncached_first)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def check_invariants(self, holders: dict[int, int]) -> None:
        """A table never holds a block twice; adds one to `holders[block id]` for each entry
        (the coordinator checks them against the ref counts)."""
        for blocks in self.req_to_blocks.values():
            ids = [b.block_id for b in blocks if b is not self.null_block]
            assert len(ids) == len(set(ids)), "a request holds a block twice in one group"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
