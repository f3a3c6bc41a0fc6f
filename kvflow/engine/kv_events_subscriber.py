"""Listening to replicas' KV events: one thread per replica, a ZeroMQ SUB socket connected to
its publisher (kvflow/engine/kv_events.py), each batch applied to a BlockIndex under that
replica's key, for the cache-aware policy (kvflow/core/routing.py).

What arrives is checked before it is used: a message is at most MAX_MESSAGE_BYTES (zmq drops
the connection past it), three frames, an 8-byte sequence number and a payload that decodes
as a KVEventBatch (msgspec validates every field's type); anything else is counted and skipped.
A sequence number that goes back means the replica restarted: its cache is empty, so is its
entry in the index. A gap means batches were lost (the publisher's queue, the PUB socket's
high-water mark): counted; what they said is caught up as later events arrive."""
from __future__ import annotations

import threading
from collections.abc import Hashable

import msgspec
import zmq

from kvflow.core.block_index import BlockIndex
from kvflow.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decoder
from kvflow.logger import init_logger

logger = init_logger("kvflow.kv_events")

MAX_MESSAGE_BYTES = 64 * 2**20
MAX_ENDPOINT_CHARS = 512


def check_endpoint(endpoint: object, name: str = "kv_events_endpoint") -> str:
    """A publisher's address to connect to (tcp://HOST:PORT or ipc://PATH), or ValueError
    naming `name`."""
    if (not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_CHARS
            or not endpoint.startswith(("tcp://", "ipc://"))):
        raise ValueError(f"{name}: give a tcp://HOST:PORT or ipc://PATH address of at most "
                         f"{MAX_ENDPOINT_CHARS} characters, got {str(endpoint)[:200]!r}")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if not sep or not host or "*" in host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{name}: {endpoint!r} is not tcp://HOST:PORT (a host to connect "
                             "to, not a wildcard)")
    return endpoint


class KVEventListener:
    """Applies the batches published at `endpoint` to `index` as `replica`'s, on its own
    thread, until `close()`."""

    def __init__(self, replica: Hashable, endpoint: str, index: BlockIndex,
                 topic: str = "") -> None:
        self.replica = replica
        self.endpoint = check_endpoint(endpoint)
        self.index = index
        self.topic = topic.encode("utf-8")
        self.batches = 0  # applied
        self.gaps = 0  # times a batch went missing
        self.bad = 0  # messages skipped
        self.last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events-{endpoint}")
        self._thread.start()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)
        decode = decoder()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad += 1
                    continue
                try:
                    batch = decode.decode(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.bad += 1
                    continue
                self._apply(int.from_bytes(frames[1], "big"), batch)
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, batch) -> None:
        if self.last_seq is not None:
            if seq <= self.last_seq:  # numbering began again: the engine restarted
                self.index.cleared(self.replica)
            elif seq > self.last_seq + 1:
                self.gaps += 1
        self.last_seq = seq
        for e in batch.events:
            kind = type(e)
            if kind is BlockStored:
                self.index.stored(self.replica, e.block_hashes, e.block_size, e.group_idx)
            elif kind is BlockRemoved:
                self.index.removed(self.replica, e.block_hashes, e.group_idx)
            elif kind is AllBlocksCleared:
                self.index.cleared(self.replica)
        self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


class KVEventListeners:
    """A BlockIndex of several replicas and a listener for each replica followed."""

    def __init__(self, topic: str = "", index: BlockIndex | None = None) -> None:
        self.index = index or BlockIndex()
        self.topic = topic
        self.listeners: dict[Hashable, KVEventListener] = {}

    def listen(self, replica: Hashable, endpoint: str) -> None:
        self.drop(replica)
        self.listeners[replica] = KVEventListener(replica, endpoint, self.index, self.topic)

    def drop(self, replica: Hashable) -> None:
        """Stop following `replica`, and forget what it held."""
        listener = self.listeners.pop(replica, None)
        if listener is not None:
            listener.close()
        self.index.cleared(replica)

    def close(self) -> None:
        for replica in list(self.listeners):
            self.drop(replica)
