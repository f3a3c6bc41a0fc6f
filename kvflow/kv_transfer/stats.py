"""KVTransferStats: the KV-transfer counts, kept by the agent and sent as they are in the
engine's stats (msgspec, like the rest of the engine-core protocol)."""
from __future__ import annotations

import msgspec


class KVTransferStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Prefill/decode transfers: counts since start, and what is in flight now. The agent keeps
    the counts (written by its thread, ints, read by the engine's); the engine sends a copy
    with the two in-flight gauges filled from its scheduler."""

    leases_active: int = 0  # lent block sets not yet released (prefill side)
    loads_active: int = 0  # pulls in flight (decode side)
    leases_granted: int = 0
    leases_released: int = 0  # by the decode side (done, or will not pull)
    leases_expired: int = 0
    pulls_served: int = 0
    bytes_sent: int = 0
    blocks_sent: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    bytes_received: int = 0
    blocks_received: int = 0
    load_seconds: float = 0.0  # summed over finished pulls
    late_frames: int = 0  # answers that came after their pull ended: dropped
