"""StateManager: the KV cache group of state layers (StateSpec: Mamba2, Gated DeltaNet, short
convolutions). Such a layer keeps a fixed number of bytes per request, not per token: a conv
window and a recurrent state. A running request holds one slot of a fixed pool from the step it
is admitted until it finishes, is aborted or is preempted (a preempted request recomputes its
state from its tokens, as it recomputes its K/V). When no slot is free, a new request waits.

A running slot holds the request's latest position only. For the prefix cache the manager keeps
`num_snapshots` more slots: copies of a request's state at the last block boundary each step
crosses (the forward writes them as it passes that position), findable by that block's hash
(the attention groups' own). A new request whose
prompt starts with cached blocks resumes at the last boundary that has a snapshot (its state
copied into its slot before the step runs); where none is, no hit: never a wrong state. A
snapshot becomes findable once the step that writes it has run (`commit`), and the least
recently used one is reused first."""
from __future__ import annotations

from collections import OrderedDict

from kvflow.core.kv_cache.block_pool import KVBlock
from kvflow.core.kv_cache.spec import StateSpec
from kvflow.request import Request


class StateManager:
    """`num_slots` state slots; a request's slot id is its one-entry table (the runner reads
    and writes that slot of the group's state tensors). The lowest free slot goes first, a
    freed slot is reused next. Snapshot slots follow them: ids num_slots .. num_slots +
    num_snapshots - 1 of the same tensors."""

    def __init__(self, spec: StateSpec, num_slots: int, block_size: int = 16,
                 num_snapshots: int = 0) -> None:
        if num_slots <= 0:
            raise ValueError(f"a state layer needs at least one state slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.block_size = block_size
        self.num_snapshots = num_snapshots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest first
        self.req_to_slot: dict[str, int] = {}
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, LRU first
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._pending: list[tuple[str, bytes, int]] = []  # (request, hash, slot) the step writes
        # what this step's forward does with slots: copies (from, to) before it (a hit's
        # snapshot into the request's slot), snapshots it takes (request id, position, slot)
        self.restores: list[tuple[int, int]] = []
        self.saves: list[tuple[str, int, int]] = []

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

    # -- prefix caching: snapshots at block boundaries ------------------------------------
    def find_cached(self, req: Request, hashes: list[bytes], n: int) -> list[bytes | None]:
        """Each of the first n blocks' hash where a snapshot of the state at its end is kept
        (None where none is)."""
        if not self.snapshots:
            return [None] * n
        return [h if h in self.snapshots else None for h in hashes[:n]]

    def cut(self, found: list[bytes | None], n: int) -> int:
        """The longest hit of at most n blocks that ends where a snapshot is."""
        while n > 0 and found[n - 1] is None:
            n -= 1
        return n

    def hit_table(self, found: list[bytes | None], n: int) -> list[KVBlock]:
        return []  # a state holds no blocks: take() resumes from the snapshot at found[n - 1]

    def cache_blocks(self, req: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Keep a snapshot of `req`'s state at the last block boundary this step crosses (the
        step runs it up to `num_tokens` positions): the forward writes it, it is findable once
        the step has run (`commit`)."""
        start = req.num_computed_tokens
        boundary = min(num_tokens, req.num_tokens) // self.block_size * self.block_size
        if not self.num_snapshots or boundary <= start:
            return
        i = boundary // self.block_size - 1
        if i >= len(hashes) or hashes[i] in self.snapshots or req.request_id not in self.req_to_slot:
            return
        if self._free_snapshots:
            snap = self._free_snapshots.pop()
        elif self.snapshots:
            _, snap = self.snapshots.popitem(last=False)  # the least recently used
        else:
            return  # every snapshot is being written this step
        self._pending.append((req.request_id, hashes[i], snap))
        self.saves.append((req.request_id, boundary, snap))

    def commit(self) -> None:
        """The step that wrote the pending snapshots has run: they become findable."""
        for _, key, snap in self._pending:
            self.snapshots[key] = snap
        self._pending.clear()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
        """This step's restores (from, to) and snapshots (request id, position, slot)."""
        copies = (self.restores, self.saves)
        self.restores, self.saves = [], []
        return copies

    def reset_prefix_cache(self) -> None:
        self._free_snapshots.extend(self.snapshots.values())
        self.snapshots.clear()

    # -- taking and giving back ------------------------------------------------------------
    def take(self, req: Request, hit: list[KVBlock], num_new: int,
             resume: bytes | None = None) -> list[KVBlock]:
        """Give the request a slot the first time it is allocated; `resume`: the block hash
        whose snapshot its prefix-cache hit starts from (copied into the slot before the
        step). Returns no blocks."""
        rid = req.request_id
        if rid not in self.req_to_slot:
            assert self._free, "the coordinator checked has_room"
            self.req_to_slot[rid] = slot = self._free.pop()
            if resume is not None:
                self.snapshots.move_to_end(resume)  # the most recently used now
                self.restores.append((self.snapshots[resume], slot))
        return []

    def free(self, request_id: str, uncached_first: bool = False) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is None:
            return
        self._free.append(slot)
        # a snapshot it was to write this step is not kept (its slot may be taken again)
        mine = [p for p in self._pending if p[0] == request_id]
        if mine:
            self._pending = [p for p in self._pending if p[0] != request_id]
            gone = {snap for _, _, snap in mine}
            self.saves = [c for c in self.saves if c[0] != request_id]
            self._free_snapshots.extend(gone)
        self.restores = [c for c in self.restores if c[1] != slot]

    def block_ids(self, request_id: str) -> list[int]:
        slot = self.req_to_slot.get(request_id)
        return [] if slot is None else [slot]

    def check_invariants(self, holders: dict[int, int]) -> None:
        """Holds no blocks; checks its own slots: each held once or free, none lost; each
        snapshot slot cached, being written or free."""
        held = list(self.req_to_slot.values())
        assert len(held) == len(set(held)), "two requests hold one state slot"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a state slot was lost"
        snaps = list(self.snapshots.values()) + [s for _, _, s in self._pending] + self._free_snapshots
        assert sorted(snaps) == list(range(self.num_slots, self.num_slots + self.num_snapshots)), \
            "a snapshot slot was lost"
