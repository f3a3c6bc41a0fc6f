"""Which KV blocks each replica holds, as its KV events say: for cache-aware routing by the
replicas' real prefix caches rather than by what was sent where.

A replica's engine publishes BlockStored when full blocks become findable in its prefix cache,
BlockRemoved when it evicts them and AllBlocksCleared on a reset (kvflow/engine/kv_events.py);
whoever subscribes applies them here, and a request is scored by the longest run of its
prompt's leading block hashes (kvflow.core.kv_cache.block_pool.hash_token_blocks) that a
replica holds: the tokens that replica would not compute again. Only attention group 0's blocks
count (a model with one group has no group index). Thread-safe: events arrive on a subscriber
thread while requests are routed on another."""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Sequence

HASH_BYTES = 32  # kvflow's block hashes are sha256 digests


class BlockIndex:
    """replica -> the set of block hashes it holds, at most `max_blocks` per replica (past it a
    stored block is not recorded: the replica seems to hold less than it does, never more).

    Besides what the events say, the prompt blocks of the requests in flight on a replica
    (`running`, counted by whoever sends them) count as held: a running request's blocks are in
    its replica's cache and cannot be evicted, and a burst of one prompt then follows its first
    request instead of spreading before that request's BlockStored comes back."""

    def __init__(self, max_blocks: int = 2**21) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # learnt from the first BlockStored
        self._held: dict[Hashable, set[bytes]] = {}
        self._running: dict[Hashable, Counter] = {}  # replica -> hash -> requests in flight
        self._lock = threading.Lock()

    def running(self, replica: Hashable, block_hashes: Sequence[bytes], delta: int) -> None:
        """A request with these prompt blocks started (+1) or ended (-1) on `replica`."""
        with self._lock:
            counts = self._running.setdefault(replica, Counter())
            for h in block_hashes:
                n = counts[h] + delta
                if n > 0:
                    counts[h] = n
                else:
                    del counts[h]

    def stored(self, replica: Hashable, block_hashes: Sequence, block_size: int,
               group_idx: int | None = None) -> None:
        if group_idx not in (None, 0):
            return
        with self._lock:
            if self.block_size is None:
                self.block_size = block_size
            elif block_size != self.block_size:
                return  # a replica with another block size: its hashes never match ours
            held = self._held.setdefault(replica, set())
            for h in block_hashes:
                if len(held) >= self.max_blocks:
                    break
                if type(h) is bytes and len(h) == HASH_BYTES:
                    held.add(h)

    def removed(self, replica: Hashable, block_hashes: Sequence,
                group_idx: int | None = None) -> None:
        if group_idx not in (None, 0):
            return
        with self._lock:
            held = self._held.get(replica)
            if held:
                held.difference_update(h for h in block_hashes if type(h) is bytes)

    def cleared(self, replica: Hashable) -> None:
        """The replica holds nothing (a reset, a restart, or it left)."""
        with self._lock:
            self._held.pop(replica, None)

    def matched(self, replicas: Sequence[Hashable], block_hashes: Sequence[bytes]) -> dict:
        """Each replica's count of leading `block_hashes` it holds (0 if none)."""
        out = {}
        with self._lock:
            for r in replicas:
                held = self._held.get(r, ())
                running = self._running.get(r, ())
                n = 0
                for h in block_hashes:
                    if h not in held and h not in running:
                        break
                    n += 1
                out[r] = n
        return out

    def size(self, replica: Hashable) -> int:
        """Blocks the replica holds, as its events say."""
        return len(self._held.get(replica, ()))
