"""KVCacheCoordinator: the one KV cache object the scheduler asks (its `kv_cache_manager`).

A model's layers form KV cache groups (groups.py), each with a spec (spec.py); the coordinator
builds one manager per group: FullAttentionManager, SlidingWindowManager (block tables over one
shared BlockPool) or StateManager (one state slot per running request). It hashes a request's
blocks once, asks every manager, and answers for all of them at once: allocate_slots is all or
nothing over every group, a prefix-cache hit is as long as every group can serve, and a request
fits only where every group has room. The scheduler never asks which kinds there are.

A model without windows is one full-attention group and no null block: exactly the single
block table of a plain paged KV cache (same block ids, same prefix-cache hits)."""
from __future__ import annotations

import sys
from array import array

from kvflow.core.kv_cache.block_pool import BlockPool, KVBlock, hash_block
from kvflow.core.kv_cache.full_attention import FullAttentionManager
from kvflow.core.kv_cache.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvflow.core.kv_cache.sliding_window import SlidingWindowManager
from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec
from kvflow.core.kv_cache.state import StateManager
from kvflow.request import Request


class ComputedBlocks(list):
    """A prefix-cache hit: the real (non-null) blocks it takes, flat (what admission counts),
    with each group's leading table in `per_group` (null blocks where a window has moved on),
    and for a state group the block hash whose snapshot the request resumes from (`resume`)."""

    per_group: list[list[KVBlock]]
    resume: dict[int, bytes]


class KVCacheCoordinator:
    """The KV cache of one model: one manager per spec in `specs` (one per KV cache group, in
    group order; attention groups first, so that group 0's table is the request's block table),
    `num_blocks` blocks of `block_size` positions shared by the attention groups, and
    `num_state_slots` slots for each state group. `max_num_batched_tokens` bounds what one step
    adds to a sliding window."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int,
                 enable_caching: bool = True, max_num_batched_tokens: int = 2048,
                 num_state_slots: int = 0) -> None:
        specs = list(specs)
        if not specs:
            raise ValueError("a model has at least one KV cache group")
        if type(specs[0]) is StateSpec:
            raise ValueError("KV cache group 0 must be an attention group (it holds the block table)")
        self.specs = specs
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # where a window has moved on, a table points here (never read); held for good. Only
        # windows need it, so that a model without them keeps every block id as it was
        has_window = any(type(s) is SlidingWindowSpec for s in specs)
        self.null_block = self.block_pool.get_new_blocks(1)[0] if has_window else None
        self.managers = [self._make_manager(g, spec, max_num_batched_tokens, num_state_slots)
                         for g, spec in enumerate(specs)]
        # what a step's allocation asks of only some kinds (looked up once, not per request)
        self._windowed = [m for m in self.managers if type(m) is SlidingWindowManager]
        self._stateful = [m for m in self.managers if type(m) is StateManager]
        self._snapshots = any(m.num_snapshots for m in self._stateful)
        self._no_hit = [[] for _ in self.managers]
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    def _make_manager(self, g: int, spec: KVCacheSpec, max_step_tokens: int, num_state_slots: int):
        # each group's copy of a block is its own cache entry
        suffix = g.to_bytes(2, "little") if len(self.specs) > 1 else b""
        kind = type(spec)
        if kind is FullAttentionSpec:
            return FullAttentionManager(self.block_pool, self.block_size, suffix, self.null_block)
        if kind is SlidingWindowSpec:
            return SlidingWindowManager(self.block_pool, self.block_size, spec.sliding_window,
                                        max_step_tokens, suffix, self.null_block)
        if kind is StateSpec:  # with prefix caching, as many snapshots as running slots
            return StateManager(spec, num_state_slots, self.block_size,
                                num_state_slots if self.enable_caching and spec.snapshots else 0)
        raise ValueError(f"no KV cache manager for {spec!r}")

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold: the pool's, less the null block."""
        return self.block_pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:
        """Group 0's block tables (request id -> blocks): who holds blocks, for the one-table view."""
        return self.managers[0].req_to_blocks

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` still lacks, over all groups, to run up to `num_tokens` positions."""
        return sum(m.num_blocks_needed(req.request_id, num_tokens) for m in self.managers)

    def max_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` positions ever holds at once."""
        return sum(m.blocks_wanted(num_tokens) for m in self.managers)

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        """How many of these cached blocks sit in the free queue (taking them uses free room)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def has_room(self, req: Request) -> bool:
        """Whether anything but blocks stops `req` now: a state group with no slot free for it.
        Always True for a model of attention layers only."""
        return all(m.has_room(req.request_id) for m in self.managers)

    # -- prefix caching --------------------------------------------------------------------
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
            extra = salt
            if req.mm_features:  # the images in the block (0xfe: never in a UTF-8 salt)
                keys = req.block_mm_keys(start + i, bs)
                if keys:
                    extra = salt + b"\xfe" + "|".join(keys).encode()
            parent = hash_block(parent, data[i * n:(i + 1) * n], extra)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[ComputedBlocks, int]:
        """The longest run of cached full blocks at the start of `req`'s tokens that every
        group can serve, never covering the last token (it must be computed to sample), and
        the number of tokens it covers. Changes nothing."""
        hit = ComputedBlocks()
        hit.per_group = [[] for _ in self.managers]
        hit.resume = {}
        if not self.enable_caching:
            return hit, 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        found = [m.find_cached(req, hashes, max_blocks) for m in self.managers]
        n = max_blocks
        changed = True
        while changed and n > 0:  # shrink until every group holds what position n * bs reads
            changed = False
            for m, blocks in zip(self.managers, found):
                cut = m.cut(blocks, n)
                if cut != n:
                    n, changed = cut, True
        for g, m in enumerate(self.managers):
            hit.per_group[g] = m.hit_table(found[g], n)
            hit.extend(b for b in hit.per_group[g] if b is not self.null_block)
            if n and type(m) is StateManager:
                hit.resume[g] = found[g][n - 1]
        return hit, n * self.block_size

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Make `req`'s full blocks up to `num_tokens` findable (their K/V are in place)."""
        if self.enable_caching:
            hashes = self._block_hashes(req, min(num_tokens, req.num_tokens) // self.block_size)
            for m in self.managers:
                m.cache_blocks(req, hashes, num_tokens)

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, cache: bool = True,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Reserve room for `num_computed_tokens + num_new_tokens` positions (after taking
        `computed_blocks`, the prefix-cache hit found at admission), plus
        `num_lookahead_tokens` more (a draft model's steps write there), in every group at
        once, after returning what the windows have left behind; a state group gives the
        request its slot. Returns group 0's newly allocated block ids (possibly none), or
        None, changing nothing, if they don't fit. Only positions of `req`'s real tokens are
        ever cached: never a draft's. `cache=False`: the new blocks are filled by something
        that may fail (a KV pull), so they become findable only through `cache_blocks` once
        they are."""
        hit = computed_blocks or []
        per_group = (getattr(hit, "per_group", None) or [list(hit) if g == 0 else []
                                                         for g in range(len(self.managers))]
                     if hit else self._no_hit)
        for m in self._windowed:
            m.remove_skipped_blocks(req)
        num_tokens = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        rid = req.request_id
        needs = [m.num_new_blocks(rid, num_tokens, len(per_group[g]))
                 for g, m in enumerate(self.managers)]
        if sum(needs) + (self.num_evictable(hit) if hit else 0) > self.block_pool.num_free_blocks:
            return None
        if self._stateful and not self.has_room(req):
            return None
        if hit:
            self.block_pool.touch(list(hit))
        new_ids: list[int] = []
        resume = getattr(hit, "resume", None) or {}
        for g, m in enumerate(self.managers):
            new = (m.take(req, per_group[g], needs[g], resume[g]) if g in resume
                   else m.take(req, per_group[g], needs[g]))
            if g == 0:
                new_ids = [b.block_id for b in new]
        if cache:
            self.cache_blocks(req, req.num_computed_tokens + num_new_tokens)
        return new_ids

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table."""
        return self.managers[0].block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block table (null entries: the null block's id, never read; a state
        group: the request's slot)."""
        return tuple(m.block_ids(request_id) for m in self.managers)

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks and slots (each table's last block first, so the tail
        is evicted before the shared prefix)."""
        for m in self.managers:
            # an embedding's blocks are never cached: reused first, evicting nobody's prefix
            m.free(req.request_id, uncached_first=req.is_pooling)

    def free_request_id(self, request_id: str) -> None:
        """`free` for blocks held under an id whose request is gone (a lent prompt's)."""
        for m in self.managers:
            m.free(request_id)

    def forget(self, req: Request) -> None:
        """Drop per-request hash memo once the request is gone for good."""
        self.req_to_hashes.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache(num_reserved=self.null_block is not None)
        if done:
            for m in self._stateful:
                m.reset_prefix_cache()
        return done

    # -- KV events -------------------------------------------------------------------------
    def record_events(self) -> None:
        """Record a KV event for every block cached or evicted, for `take_events`."""
        self.block_pool.record_events()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, oldest first. With several KV cache groups a
        pool hash ends with its group's suffix (_make_manager): here each event carries the
        sequence's own hash and the group in `group_idx` (a removal touching several groups
        becomes one event per group), so that a consumer hashing token ids finds it."""
        events = self.block_pool.take_events()
        if len(self.specs) == 1 or not events:
            return events
        out: list[KVCacheEvent] = []
        for e in events:
            if type(e) is BlockStored:
                e.group_idx = int.from_bytes(e.block_hashes[0][32:], "little")
                e.block_hashes = [h[:32] for h in e.block_hashes]
                e.parent_block_hash = e.parent_block_hash[:32] if e.parent_block_hash else None
                out.append(e)
            elif type(e) is BlockRemoved:
                by_group: dict[int, list[bytes]] = {}
                for h in e.block_hashes:
                    by_group.setdefault(int.from_bytes(h[32:], "little"), []).append(h[:32])
                out += [BlockRemoved(hs, g) for g, hs in by_group.items()]
            else:
                out.append(e)
        return out

    # -- state snapshots (models with state layers, prefix caching on) ----------------------
    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
        """This step's state slot copies before its forward, (from, to): hits resuming from
        snapshots; and the snapshots its forward takes, (request id, position, slot)."""
        if not self._snapshots:
            return [], []
        before, after = [], []
        for m in self._stateful:
            b, a = m.take_copies()
            before += b
            after += a
        return before, after

    def commit_states(self) -> None:
        """A step has run: the snapshots it wrote become findable."""
        for m in self._stateful:
            m.commit()

    def check_invariants(self) -> None:
        """Ref counts equal holders (the null block: one, its own) and are >= 0, no table
        holds a block twice, only cached blocks are shared, free + held = total; each state
        slot is held once or free."""
        null_id = self.null_block.block_id if self.null_block is not None else None
        holders: dict[int, int] = {} if null_id is None else {null_id: 1}
        for m in self.managers:
            m.check_invariants(holders)
        for block in self.block_pool.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt"
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders.get(block.block_id, 0)}")
            assert (block.ref_cnt == 0) == self.block_pool.is_free(block.block_id)
        shared = [i for i, n in holders.items() if n > 1 and i != null_id]
        assert all(self.block_pool.blocks[i].block_hash is not None for i in shared), (
            "only cached (full, hashed) blocks may be shared")
        assert self.num_free_blocks + len(holders) == self.block_pool.num_blocks
