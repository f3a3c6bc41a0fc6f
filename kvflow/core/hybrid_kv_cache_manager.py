"""HybridKVCacheManager: the KVCacheManager of a model with sliding-window layers (one block
table per KV cache group, all groups drawing from one pool; kv_cache_groups.py).

A sliding-window group needs only the blocks that hold the last `window` positions before
the next token: blocks wholly before them go back to the pool while the request runs (their
table entries point at a reserved null block, never read: attention skips or masks them).
So a long request holds ~window / block_size blocks per sliding group, and admission and
allocate_slots count that, not its whole length.

Prefix caching works per group: a group's full blocks are findable by the chained hash of
the tokens up to them (salted with the group), and a cached prefix of n blocks is usable only
where every group still has what the next token reads: all n blocks for a full-attention
group, the blocks of the last `window` positions for a sliding one."""
from __future__ import annotations

from kvflow.core.block_pool import BlockKey, KVBlock
from kvflow.core.kv_cache_groups import KVCacheGroup
from kvflow.core.kv_cache_manager import KVCacheManager, cdiv
from kvflow.request import Request


class ComputedBlocks(list):
    """A prefix-cache hit: the real (non-null) blocks it takes, flat (what admission counts),
    with each group's leading table in `per_group` (null blocks where a window has moved on)."""

    per_group: list[list[KVBlock]]


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 enable_caching: bool = True, max_num_batched_tokens: int = 2048) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.groups = groups
        self.max_step_tokens = max_num_batched_tokens
        self.null_block = self.block_pool.get_new_blocks(1)[0]  # held for good, never freed
        self.tables: list[dict[str, list[KVBlock]]] = [{} for _ in groups]
        self.num_skipped: list[dict[str, int]] = [{} for _ in groups]  # leading null entries
        self.num_cached: list[dict[str, int]] = [{} for _ in groups]
        self.req_to_blocks = self.tables[0]  # group 0's, for readers of the one-table view

    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold: the pool's, less the null block."""
        return self.block_pool.num_blocks - 1

    # -- what a window needs ---------------------------------------------------------------
    def _first_needed_block(self, group: KVCacheGroup, num_computed: int) -> int:
        """The first block the next token (at position num_computed) still reads."""
        if group.sliding_window is None:
            return 0
        return max(0, num_computed - group.sliding_window + 1) // self.block_size

    def _num_real(self, g: int, rid: str) -> int:
        return len(self.tables[g].get(rid, ())) - self.num_skipped[g].get(rid, 0)

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` still lacks, over all groups, to run up to `num_tokens` positions: all
        of them for a full-attention group; for a sliding one what a window plus one step's
        tokens spans (the rest are freed as the prompt advances)."""
        rid = req.request_id
        return sum(max(0, self._blocks_wanted(group, num_tokens) - self._num_real(g, rid))
                   for g, group in enumerate(self.groups))

    def _blocks_wanted(self, group: KVCacheGroup, num_tokens: int) -> int:
        want = cdiv(num_tokens, self.block_size)
        if group.sliding_window is not None:
            want = min(want, cdiv(group.sliding_window - 1 + self.max_step_tokens, self.block_size) + 1)
        return want

    def max_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` positions ever holds at once."""
        return sum(self._blocks_wanted(group, num_tokens) for group in self.groups)

    def _remove_skipped_blocks(self, req: Request) -> None:
        """Return the blocks each sliding group's window has left behind."""
        rid = req.request_id
        for g, group in enumerate(self.groups):
            table = self.tables[g].get(rid)
            if group.sliding_window is None or not table:
                continue
            start = self.num_skipped[g].get(rid, 0)
            end = min(self._first_needed_block(group, req.num_computed_tokens), len(table))
            if end <= start:
                continue
            gone = [b for b in table[start:end] if b is not self.null_block]
            table[start:end] = [self.null_block] * (end - start)
            self.num_skipped[g][rid] = end
            self.block_pool.free_blocks(list(reversed(gone)))

    # -- prefix caching --------------------------------------------------------------------
    def _group_hash(self, g: int, h: bytes) -> bytes:
        return h + g.to_bytes(2, "little")  # each group's copy of a block is its own entry

    def _group_key(self, g: int, req: Request, i: int, parent: KVBlock | None) -> BlockKey:
        if self.groups[g].sliding_window is None:
            return self._block_key(req, i, parent)
        # a window's earlier blocks may be gone: the chained hash stands for the prefix
        bs = self.block_size
        return BlockKey(0, tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
                        req.block_salt if i == 0 else None)

    def _lookup_group(self, g: int, req: Request, hashes: list[bytes], n: int) -> list[KVBlock | None]:
        """Group g's cached block for each of the first n blocks (None where it has none);
        a full-attention group stops at its first miss (its chain needs every parent)."""
        found: list[KVBlock | None] = []
        full = self.groups[g].sliding_window is None
        for i in range(n):
            parent = found[-1] if full and found else None
            block = self.block_pool.lookup(self._group_hash(g, hashes[i]), self._group_key(g, req, i, parent))
            if block is None and full:
                break
            found.append(block)
        return found + [None] * (n - len(found))

    def get_computed_blocks(self, req: Request) -> tuple[ComputedBlocks, int]:
        hit = ComputedBlocks()
        hit.per_group = [[] for _ in self.groups]
        if not self.enable_caching:
            return hit, 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        found = [self._lookup_group(g, req, hashes, max_blocks) for g in range(len(self.groups))]
        n = max_blocks
        changed = True
        while changed and n > 0:  # shrink until every group holds what position n * bs reads
            changed = False
            for g, group in enumerate(self.groups):
                first = self._first_needed_block(group, n * self.block_size)
                misses = [i for i in range(first, n) if found[g][i] is None]
                if misses:
                    # a full group's run ends at its first miss; a window that needs a missing
                    # block fails for every prefix that still reads it, i.e. up to that block
                    n = misses[0] if group.sliding_window is None else misses[-1]
                    changed = True
        for g, group in enumerate(self.groups):
            first = self._first_needed_block(group, n * self.block_size)
            blocks = found[g][first:n]
            hit.per_group[g] = [self.null_block] * first + blocks
            hit.extend(blocks)
        return hit, n * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, cache: bool = True,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """As KVCacheManager.allocate_slots (lookahead room for drafts included), over every
        group at once (all or nothing), after returning what the windows have left behind.
        Returns group 0's new block ids."""
        rid = req.request_id
        per_group = getattr(computed_blocks, "per_group", None) or [[] for _ in self.groups]
        self._remove_skipped_blocks(req)
        num_tokens = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needs = []
        for g in range(len(self.groups)):
            held = len(self.tables[g].get(rid, ())) + len(per_group[g])
            needs.append(max(0, cdiv(num_tokens, self.block_size) - held))
        hit = computed_blocks or []
        if sum(needs) + self.num_evictable(hit) > self.block_pool.num_free_blocks:
            return None
        if hit:
            self.block_pool.touch(list(hit))
        new_ids: list[int] = []
        for g, group in enumerate(self.groups):
            table = self.tables[g].setdefault(rid, [])
            if per_group[g]:
                table.extend(per_group[g])
                self.num_skipped[g][rid] = self._first_needed_block(group, req.num_computed_tokens)
                self.num_cached[g][rid] = len(per_group[g])
            new = self.block_pool.get_new_blocks(needs[g])
            table.extend(new)
            if g == 0:
                new_ids = [b.block_id for b in new]
            if self.enable_caching and cache:  # real tokens only (drafts: never)
                self._cache_group_blocks(g, req, table, req.num_computed_tokens + num_new_tokens)
        return new_ids

    def _cache_group_blocks(self, g: int, req: Request, table: list[KVBlock], num_tokens: int) -> None:
        rid = req.request_id
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached[g].get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        full = self.groups[g].sliding_window is None
        for i in range(start, num_full):
            block = table[i]
            parent = table[i - 1] if full and i else None
            if block is self.null_block or (parent is not None and parent.block_hash is None):
                break
            self.block_pool.cache_block(block, self._group_hash(g, hashes[i]), self._group_key(g, req, i, parent))
        self.num_cached[g][rid] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables[0].get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block table (null entries: block 0, never read)."""
        return tuple([b.block_id for b in t.get(request_id, ())] for t in self.tables)

    def free(self, req: Request) -> None:
        rid = req.request_id
        for g in range(len(self.groups)):
            blocks = self.tables[g].pop(rid, [])
            self.num_skipped[g].pop(rid, None)
            self.num_cached[g].pop(rid, None)
            self.block_pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block],
                                        uncached_first=req.is_pooling)

    def check_invariants(self) -> None:
        """Ref counts equal holders (the null block: one, its own), no table holds a block
        twice, and free + held = total."""
        holders: dict[int, int] = {self.null_block.block_id: 1}
        for tables in self.tables:
            for blocks in tables.values():
                ids = [b.block_id for b in blocks if b is not self.null_block]
                assert len(ids) == len(set(ids)), "a request holds a block twice in one group"
                for i in ids:
                    holders[i] = holders.get(i, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders.get(block.block_id, 0)}")
            assert (block.ref_cnt == 0) == self.block_pool.is_free(block.block_id)
        assert self.num_free_blocks + len(holders) == self.block_pool.num_blocks
