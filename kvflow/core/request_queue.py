"""RequestQueue: the scheduler's waiting queue, with O(1) removal from anywhere.

A deque holds entries in queue order; removing a request only marks its entry dead (found
through a dict by request id), and dead entries are dropped when they reach either end or,
once they outnumber the live ones, by one compaction pass. Aborting k of n waiting requests
therefore costs O(k) amortised, not O(k * n)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvflow.request import Request


class _Entry:
    __slots__ = ("req", "alive")

    def __init__(self, req: Request) -> None:
        self.req, self.alive = req, True


class RequestQueue:
    """Queue order with append, appendleft, insert-by-key and O(1) `remove`. Iterating,
    `len`, `bool` and `[i]` see only the requests still in it."""

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque()
        self._live: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (e.req for e in self._entries if e.alive)

    def __getitem__(self, i: int) -> Request:
        if i < 0:
            i += len(self._live)
        if not 0 <= i < len(self._live):
            raise IndexError("waiting queue index out of range")
        for k, req in enumerate(self):
            if k == i:
                return req
        raise AssertionError("unreachable")

    def __contains__(self, req: Request) -> bool:
        e = self._live.get(req.request_id)
        return e is not None and e.req is req

    def _add(self, req: Request) -> _Entry:
        assert req.request_id not in self._live, f"{req.request_id} is already waiting"
        e = self._live[req.request_id] = _Entry(req)
        return e

    def append(self, req: Request) -> None:
        self._entries.append(self._add(req))

    def appendleft(self, req: Request) -> None:
        self._entries.appendleft(self._add(req))

    def insert_sorted(self, req: Request, key) -> None:
        """Insert after every live request whose key(r) <= key(req) (stable); O(n)."""
        k = key(req)
        i = len(self._entries)
        while i > 0 and (not self._entries[i - 1].alive or key(self._entries[i - 1].req) > k):
            i -= 1
        self._entries.insert(i, self._add(req))

    def remove(self, req: Request) -> None:
        """O(1) amortised; ValueError if `req` is not in the queue."""
        e = self._live.get(req.request_id)
        if e is None or e.req is not req:
            raise ValueError(f"request {req.request_id!r} is not waiting")
        del self._live[req.request_id]
        e.alive = False
        entries = self._entries
        while entries and not entries[0].alive:
            entries.popleft()
        while entries and not entries[-1].alive:
            entries.pop()
        if len(entries) > 2 * len(self._live) + 32:  # mostly dead: one pass, paid by the removals
            self._entries = deque(e for e in entries if e.alive)

    @property
    def storage_size(self) -> int:
        """Entries held, dead ones included (bounded by 2 x len + 32): for tests."""
        return len(self._entries)
