"""BlockPool: owns the KV blocks, their reference counts and the free queue."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Fixed set of `num_blocks` blocks. Free blocks wait in a queue (oldest freed first),
    so that a later prefix cache can evict least-recently-used blocks in O(1)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue (ref count becomes 1)."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds go to the back of the queue.
        Callers pass a request's blocks in reverse so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt went negative"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free
