"""KV events on the wire: vLLM's KVEventBatch, and the ZeroMQ publisher that sends them.

The block pool records plain events (kvflow/core/kv_cache/kv_events.py); once a step the
engine core drains them into one KVEventBatch(ts, events, data_parallel_rank) and hands it to
`ZmqEventPublisher.publish`, which only queues it: a thread encodes it with msgspec's msgpack
and sends the multipart message [topic, sequence number (8 bytes, big-endian), payload] on a
PUB socket, and keeps the last `buffer_steps` batches for a subscriber that asks a replay
ROUTER socket for those from a sequence number on (vLLM's protocol: [b"", start seq]; answered
by [b"", seq, payload] frames and an end marker of seq -1). The structs are vLLM's, field for
field, so a consumer written for vLLM's events decodes ours."""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from kvflow.config import KVEventsConfig
from kvflow.core.kv_cache import kv_events as core_events
from kvflow.logger import init_logger

logger = init_logger("kvflow.kv_events")

ExternalBlockHash = bytes | int  # vLLM's; kvflow's hashes are 32-byte sha256 digests
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A tagged union member: its msgpack map carries "type": the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[core_events.KVCacheEvent], medium: str) -> list[KVCacheEvent]:
    """The core's records as vLLM's structs (`medium`: where the blocks live, CPU or GPU)."""
    out: list[KVCacheEvent] = []
    for e in events:
        kind = type(e)
        if kind is core_events.BlockStored:
            out.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids,
                                   e.block_size, e.lora_id, medium, None, group_idx=e.group_idx))
        elif kind is core_events.BlockRemoved:
            out.append(BlockRemoved(e.block_hashes, medium, e.group_idx))
        else:
            out.append(AllBlocksCleared())
    return out


def _binds(endpoint: str) -> bool:
    # vLLM's convention: bind a stable address (a wildcard, ipc, inproc), connect to another
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Queues batches from the engine loop (never blocking it: past `max_queue_size` waiting
    batches a batch is dropped, and a subscriber sees the gap in the sequence numbers) and
    sends them from a thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.data_parallel_rank = config.data_parallel_rank or 0  # vLLM stamps 0 on one engine
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        self.dropped = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"kv_events_config: cannot open {config.endpoint} "
                          f"(or its replay endpoint): {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV events: the publisher's queue is full (%d batches); "
                               "dropping batches", self.config.max_queue_size)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                logger.warning("KV events: send failed: %s", e)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: [identity, b"", start seq]
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)  # what the thread sent still leaves
        if self._replay is not None:
            self._replay.close(linger=0)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher a config asks for; None where events are off (or the `null` publisher)."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config)


def decoder() -> msgspec.msgpack.Decoder:
    """Decodes one payload frame into a KVEventBatch (a msgspec.DecodeError / ValidationError
    on anything else)."""
    return msgspec.msgpack.Decoder(KVEventBatch)
