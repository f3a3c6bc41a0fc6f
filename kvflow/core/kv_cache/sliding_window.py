"""SlidingWindowManager: the block table of one KV cache group whose layers attend to the last
`sliding_window` positions only.

Such a group needs only the blocks that hold the last `window` positions before the next
token: blocks wholly before them go back to the pool while the request runs (their table
entries point at the coordinator's reserved null block, never read: attention skips or masks
them). So a long request holds ~window / block_size blocks here, and admission and
allocate_slots count that, not its whole length.

Its full blocks are findable by the chained hash of the tokens up to them, and a cached prefix
of n blocks is usable here only if the group still has the blocks of the last `window`
positions before position n * block_size."""
from __future__ import annotations

from kvflow.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock, cdiv
from kvflow.core.kv_cache.full_attention import FullAttentionManager
from kvflow.request import Request


class SlidingWindowManager(FullAttentionManager):
    """A full-attention table whose leading entries turn into the null block as the window
    moves on; `max_step_tokens` (the step's token budget) bounds what one step adds."""

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int,
                 max_step_tokens: int, hash_suffix: bytes, null_block: KVBlock) -> None:
        super().__init__(block_pool, block_size, hash_suffix, null_block)
        self.sliding_window = sliding_window
        self.max_step_tokens = max_step_tokens
        self.num_skipped: dict[str, int] = {}  # leading null entries of each table

    def first_needed_block(self, num_computed: int) -> int:
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def blocks_wanted(self, num_tokens: int) -> int:
        """What a window plus one step's tokens spans (the rest are freed as the prompt
        advances)."""
        want = cdiv(num_tokens, self.block_size)
        return min(want, cdiv(self.sliding_window - 1 + self.max_step_tokens, self.block_size) + 1)

    def num_real_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ())) - self.num_skipped.get(request_id, 0)

    def remove_skipped_blocks(self, req: Request) -> None:
        """Return the blocks the window has left behind."""
        rid = req.request_id
        table = self.req_to_blocks.get(rid)
        if not table:
            return
        start = self.num_skipped.get(rid, 0)
        end = min(self.first_needed_block(req.num_computed_tokens), len(table))
        if end <= start:
            return
        gone = [b for b in table[start:end] if b is not self.null_block]
        table[start:end] = [self.null_block] * (end - start)
        self.num_skipped[rid] = end
        self.block_pool.free_blocks(list(reversed(gone)))

    def block_key(self, req: Request, i: int, parent: KVBlock | None) -> BlockKey:
        # a window's earlier blocks may be gone: the chained hash stands for the prefix
        bs = self.block_size
        return BlockKey(0, tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
                        req.block_salt if i == 0 else None,
                        req.block_mm_keys(i, bs) if req.mm_features else ())

    def _parent(self, table: list[KVBlock], i: int) -> KVBlock | None:
        return None

    def find_cached(self, req: Request, hashes: list[bytes], n: int) -> list[KVBlock | None]:
        """Every block looked up on its own: a window does not need the run before it."""
        return [self.block_pool.lookup(hashes[i] + self.hash_suffix, self.block_key(req, i, None))
                for i in range(n)]

    def cut(self, found: list[KVBlock | None], n: int) -> int:
        """A window that needs a missing block fails for every prefix that still reads it,
        i.e. up to that block."""
        misses = [i for i in range(self.first_needed_block(n * self.block_size), n) if found[i] is None]
        return misses[-1] if misses else n

    def take(self, req: Request, hit: list[KVBlock], num_new: int) -> list[KVBlock]:
        if hit:
            self.num_skipped[req.request_id] = self.first_needed_block(req.num_computed_tokens)
        return super().take(req, hit, num_new)

    def free(self, request_id: str, uncached_first: bool = False) -> None:
        self.num_skipped.pop(request_id, None)
        super().free(request_id, uncached_first)
