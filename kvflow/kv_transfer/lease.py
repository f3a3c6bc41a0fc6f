"""LeaseTable: the prefill side's record of lent block sets. A lease names the blocks of one
finished prompt; it ends when the decode side says it has them, or when no heartbeat has come
for `timeout_s` (a vanished decode instance or router never strands blocks)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float


class LeaseTable:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self.leases)

    def add(self, transfer_id: str, block_ids: list[int], num_tokens: int, now: float) -> None:
        assert transfer_id not in self.leases, f"lease {transfer_id} granted twice"
        self.leases[transfer_id] = Lease(transfer_id, list(block_ids), num_tokens,
                                         now + self.timeout_s)

    def get(self, transfer_id: str) -> Lease | None:
        return self.leases.get(transfer_id)

    def extend(self, transfer_id: str, now: float) -> bool:
        """A heartbeat (or a pull): the lease lives `timeout_s` from now."""
        lease = self.leases.get(transfer_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, now + self.timeout_s)
        return True

    def pop(self, transfer_id: str) -> Lease | None:
        return self.leases.pop(transfer_id, None)

    def expired(self, now: float) -> list[Lease]:
        """Remove and return every lease past its time."""
        gone = [lease for lease in self.leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self.leases[lease.transfer_id]
        return gone
