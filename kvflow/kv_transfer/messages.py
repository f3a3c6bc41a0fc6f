"""The KV-transfer wire protocol between a decode instance's DEALER and a prefill instance's
ROUTER (msgspec msgpack headers; K/V as raw frames, sent without copying):

    consumer -> producer   [PULL, PullRequest]     the blocks of one transfer
                           [BEAT, transfer id]     keep the lease while waiting
                           [DONE, transfer id]     got them: release the lease
                           [RELEASE, transfer id]  will not pull (aborted, refused)
    producer -> consumer   [KV, KVHeader, k_0, v_0, k_1, v_1, ...]  one frame per layer and
                           K/V, the blocks in order; none when `shm_path` names a shared-memory
                           file with the same bytes, or when `error` says why not
"""
from __future__ import annotations

import msgspec

PULL, BEAT, DONE, RELEASE, KV = b"P", b"B", b"D", b"R", b"K"


class PullRequest(msgspec.Struct, array_like=True):
    transfer_id: str
    block_ids: list[int]  # the producer's blocks, in the order the consumer wants them
    compat: dict[str, str | int]  # the consumer's KV layout: checked at this handshake
    host_id: str  # equal to the producer's: both sit on one host
    use_shm: bool = False


class KVHeader(msgspec.Struct, array_like=True, omit_defaults=True):
    transfer_id: str
    error: str | None = None
    shm_path: str | None = None
    num_bytes: int = 0


encoder = msgspec.msgpack.Encoder()
pull_decoder = msgspec.msgpack.Decoder(PullRequest)
header_decoder = msgspec.msgpack.Decoder(KVHeader)
str_decoder = msgspec.msgpack.Decoder(str)
