"""KVCacheManager: which blocks each request holds; allocate_slots is all-or-nothing."""
from __future__ import annotations

from kvflow.core.block_pool import BlockPool, KVBlock
from kvflow.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

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

    def allocate_slots(self, req: Request, num_new_tokens: int) -> list[int] | None:
        """Reserve room for `num_computed_tokens + num_new_tokens` positions. Returns the ids of
        the newly allocated blocks (possibly none), or None, changing nothing, if they don't fit."""
        need = self.num_blocks_needed(req, req.num_computed_tokens + num_new_tokens)
        if need > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(need)
        self.req_to_blocks.setdefault(req.request_id, []).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks to the pool (its last block first)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.block_pool.free_blocks(list(reversed(blocks)))

    def check_invariants(self) -> None:
        """No block held twice, ref counts match holders and are >= 0, free + used = total."""
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt"
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders.get(block.block_id, 0)}")
            assert (block.ref_cnt == 0) == self.block_pool.is_free(block.block_id)
        assert all(n == 1 for n in holders.values()), "a block is owned by two requests"
        assert self.num_free_blocks + len(holders) == self.num_total_blocks
