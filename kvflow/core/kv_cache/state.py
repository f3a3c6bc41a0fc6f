"""StateManager: the KV cache group of state layers (StateSpec: Mamba2, Gated DeltaNet, short
convolutions). Such a layer keeps a fixed number of bytes per request, not per token: a conv
window and a recurrent state. A running request holds one slot of a fixed pool from the step it
is admitted until it finishes, is aborted or is preempted (a preempted request recomputes its
state from its tokens, as it recomputes its K/V). When no slot is free, a new request waits.

A state holds the request's latest position only, so nothing here is ever found again by the
prefix cache: a model with state layers computes every prompt from its start."""
from __future__ import annotations

from kvflow.core.kv_cache.block_pool import KVBlock
from kvflow.core.kv_cache.spec import StateSpec
from kvflow.request import Request


class StateManager:
    """`num_slots` state slots; a request's slot id is its one-entry table (the runner reads
    and writes that slot of the group's state tensors). The lowest free slot goes first, a
    freed slot is reused next."""

    def __init__(self, spec: StateSpec, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a state layer needs at least one state slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest first
        self.req_to_slot: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    # -- what a request needs: a slot, no blocks -------------------------------------------
    def blocks_wanted(self, num_tokens: int) -> int:
        return 0

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return 0

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit: int) -> int:
        return 0

    def has_room(self, request_id: str) -> bool:
        """It holds a slot already, or one is free."""
        return request_id in self.req_to_slot or bool(self._free)

    def remove_skipped_blocks(self, req: Request) -> None:
        """A state is overwritten in place: nothing falls behind."""

    # -- prefix caching: never a hit -------------------------------------------------------
    def find_cached(self, req: Request, hashes: list[bytes], n: int) -> list[KVBlock | None]:
        return [None] * n

    def cut(self, found: list[KVBlock | None], n: int) -> int:
        return 0  # no state is kept at a block boundary

    def hit_table(self, found: list[KVBlock | None], n: int) -> list[KVBlock]:
        return []

    def cache_blocks(self, req: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Nothing to make findable."""

    # -- taking and giving back ------------------------------------------------------------
    def take(self, req: Request, hit: list[KVBlock], num_new: int) -> list[KVBlock]:
        """Give the request a slot the first time it is allocated; returns no blocks."""
        if req.request_id not in self.req_to_slot:
            assert self._free, "the coordinator checked has_room"
            self.req_to_slot[req.request_id] = self._free.pop()
        return []

    def free(self, request_id: str, uncached_first: bool = False) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def block_ids(self, request_id: str) -> list[int]:
        slot = self.req_to_slot.get(request_id)
        return [] if slot is None else [slot]

    def check_invariants(self, holders: dict[int, int]) -> None:
        """Holds no blocks; checks its own slots: each held once or free, none lost."""
        held = list(self.req_to_slot.values())
        assert len(held) == len(set(held)), "two requests hold one state slot"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a state slot was lost"
