"""KVTransferAgent: one background thread per engine that serves lent blocks (prefill side,
a ROUTER socket on `kv_port`) and pulls remote blocks (decode side, one DEALER per prefill
instance). The engine's own thread keeps the scheduler and writes the KV cache: the agent only
*reads* leased blocks (nobody writes a lent block) and hands received bytes over as events.

    engine thread  --commands-->  agent thread     offer / load / cancel / release_remote
    engine thread  <--events---   agent thread     released / loaded / failed

Each hand-over is a queue entry plus one byte on an inproc PAIR socket, which the engine-core
loop polls next to its input socket, so an idle engine wakes for a release or an arrival."""
from __future__ import annotations

import hashlib
import json
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import zmq

from kvflow.config import KVTransferConfig
from kvflow.core.scheduler_output import KVLoad
from kvflow.kv_transfer import messages as m
from kvflow.kv_transfer.blocks import (PagedKV, gather_frames, gather_into, scatter, scatter_tokens,
                                      transfer_bytes)
from kvflow.kv_transfer.lease import LeaseTable
from kvflow.kv_transfer.params import KVTransferParams, compat_mismatch
from kvflow.kv_transfer.shm import MappingCache, StagingPool, available, is_staging_path
from kvflow.kv_transfer.stats import KVTransferStats
from kvflow.logger import init_logger

logger = init_logger("kvflow.kv_transfer")

_TICK_S = 0.05  # the agent's clock: lease expiry, heartbeats, pull deadlines


def host_id() -> str:
    """Equal for two processes on one host (and one boot): shared memory can join them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def compat_hash(compat: dict) -> str:
    return hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class _Pending:
    load: KVLoad
    peer: tuple[str, int]
    started: float
    deadline: float
    next_beat: float


@dataclass
class Event:
    kind: str  # "released" | "loaded" | "failed"
    req_id: str
    load: KVLoad | None = None
    frames: list = field(default_factory=list)  # zmq frames, or one shared-memory tensor view
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    peer: tuple[str, int] | None = None


class KVTransferAgent:
    def __init__(self, config: KVTransferConfig, compat: dict, kv: PagedKV, block_size: int) -> None:
        self.config = config
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self.host_id = host_id()
        self.compat = dict(compat)
        self.compat_hash = compat_hash(self.compat)
        self.kv = kv  # every KV head, over the tensor-parallel ranks that hold them
        self.block_size = block_size
        self.stats = KVTransferStats()  # the counts; the engine fills the gauges
        self.leases = LeaseTable(config.kv_lease_timeout_s)  # the agent thread's alone
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.ctx = zmq.Context()
        addr = f"inproc://kvflow-kv-{uuid.uuid4().hex}"
        self._thread_end = self.ctx.socket(zmq.PAIR)
        self._thread_end.bind(addr)
        self.wakeup_socket = self.ctx.socket(zmq.PAIR)  # the engine thread's end
        self.wakeup_socket.connect(addr)
        self.router = None
        if config.is_producer:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.router.setsockopt(zmq.MAXMSGSIZE, 1 << 24)  # pulls are small; anything else is not one
            try:
                self.router.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            except zmq.ZMQError as e:
                self.close_sockets()
                raise OSError(f"kv_transfer_config: cannot listen on {config.kv_ip}:"
                              f"{config.kv_port}: {e}") from None
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        self._pending: dict[str, _Pending] = {}  # transfer id -> pull in flight
        self._watched: dict[str, list] = {}  # transfer id -> [peer, next heartbeat]: queued
        self._staging = StagingPool() if config.is_producer and available() else None
        self._mappings = MappingCache()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvflow-kv-transfer", daemon=True)
        self._thread.start()

    # -- the engine thread's side ----------------------------------------------------------
    def params_for(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVTransferParams:
        """What a producer's response carries: everything a decode instance needs to pull."""
        return KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id,
            remote_host=self.config.kv_ip, remote_port=self.config.kv_port,
            remote_block_ids=list(block_ids), remote_num_tokens=num_tokens,
            remote_block_size=self.block_size, remote_host_id=self.host_id,
            transfer_id=request_id, compat_hash=self.compat_hash, compat=dict(self.compat))

    def check_compatible(self, p: KVTransferParams) -> None:
        """ValueError naming what differs, if `p`'s blocks cannot be used here as they are."""
        if p.remote_block_size % 2:  # a cache tile pairs keys (kv_layout.py): never odd
            raise ValueError(f"kv_transfer_params.remote_block_size {p.remote_block_size} is odd; "
                             "a kvflow cache's block size is even")
        diff = compat_mismatch(self.compat, p.compat)
        if diff is not None or p.compat_hash != self.compat_hash:
            raise ValueError(f"kv_transfer_params: incompatible KV cache: {diff or 'hash differs'}")

    def offer(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> None:
        self._command("offer", transfer_id, block_ids, num_tokens, time.monotonic())

    def load(self, load: KVLoad) -> None:
        self._command("load", load, time.monotonic())

    def watch(self, p: KVTransferParams) -> None:
        """A request waits to pull `p` (for blocks, say): keep its lease alive meanwhile."""
        self._command("watch", (p.remote_host, p.remote_port), p.transfer_id, time.monotonic())

    def cancel(self, req_id: str, p: KVTransferParams) -> None:
        """Stop waiting for a pull, started or not (its request ended); the producer is told."""
        self._command("cancel", req_id, (p.remote_host, p.remote_port), p.transfer_id)

    def release_remote(self, p: KVTransferParams, done: bool = False) -> None:
        """Tell a producer that its lease is not needed any more: the blocks are copied here
        (`done`), or will never be (a refused or aborted request)."""
        self._command("done" if done else "release", (p.remote_host, p.remote_port),
                      p.transfer_id)

    def _command(self, *cmd) -> None:
        self._commands.put(cmd)
        self.wakeup_socket.send(b"c")

    def drain_events(self) -> list[Event]:
        """Every event so far (non-blocking); consumes the wake-up bytes."""
        while True:
            try:
                self.wakeup_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout_s: float) -> None:
        """Block until the agent has news or `timeout_s` passes."""
        self.wakeup_socket.poll(int(timeout_s * 1000))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def shutdown(self) -> None:
        if self._running:
            self._command("stop")
            self._thread.join(timeout=5)
        self.close_sockets()

    def close_sockets(self) -> None:
        if self._staging is not None:
            self._staging.close()
        self._mappings.close()
        for s in [self._thread_end, self.wakeup_socket, self.router, *self._dealers.values()]:
            if s is not None:
                s.close(linger=0)
        self.ctx.term()

    # -- the agent thread ------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self.events.put(event)
        self._thread_end.send(b"e")

    def _run(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._thread_end, zmq.POLLIN)
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        try:
            while self._running:
                ready = dict(poller.poll(int(_TICK_S * 1000)))
                if self._thread_end in ready:
                    self._drain_commands()
                if self.router is not None and self.router in ready:
                    self._serve(self.router)
                for dealer in list(self._dealers.values()):
                    if dealer in ready:
                        self._receive(dealer)
                self._tick(time.monotonic())
        except Exception:  # noqa: BLE001 - a bug here must not hang the decode side silently
            logger.exception("kvflow: the KV-transfer agent failed")
            for tid, p in list(self._pending.items()):
                self._fail(tid, "the KV-transfer agent failed")

    def _drain_commands(self) -> None:
        while True:
            try:
                self._thread_end.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "offer":
                _, tid, block_ids, num_tokens, now = cmd
                self.leases.add(tid, block_ids, num_tokens, now)
                self.stats.leases_granted += 1
            elif kind == "load":
                self._start_pull(cmd[1], cmd[2])
            elif kind == "watch":
                _, peer, tid, now = cmd
                self._watched[tid] = [peer, now + self.config.kv_lease_timeout_s / 3]
            elif kind == "cancel":
                _, req_id, peer, tid = cmd
                self._watched.pop(tid, None)
                p = self._pending.get(tid)
                if p is not None and p.load.req_id == req_id:
                    del self._pending[tid]
                self._send(peer, [m.RELEASE, m.encoder.encode(tid)])
            elif kind in ("release", "done"):
                self._send(cmd[1], [m.RELEASE if kind == "release" else m.DONE,
                                    m.encoder.encode(cmd[2])])
            elif kind == "stop":
                self._running = False
                return

    def _send(self, peer: tuple[str, int], frames: list) -> None:
        """To a prefill instance, over its one DEALER (made on first use)."""
        s = self._dealers.get(peer)
        if s is None:
            s = self._dealers[peer] = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{peer[0]}:{peer[1]}")
            self._poller.register(s, zmq.POLLIN)
        s.send_multipart(frames, copy=False)

    def _start_pull(self, load: KVLoad, started: float) -> None:
        p = load.params
        peer = (p.remote_host, p.remote_port)
        tid = p.transfer_id
        now = time.monotonic()
        self._watched.pop(tid, None)  # from here on the pull's own heartbeats
        if tid in self._pending:  # two requests cannot pull one lease
            self.stats.loads_failed += 1
            self._emit(Event("failed", load.req_id, load, error=f"transfer {tid!r} is already "
                                                               "being pulled"))
            return
        self._pending[tid] = _Pending(load, peer, started, now + self.config.kv_load_timeout_s,
                                      now + self.config.kv_lease_timeout_s / 3)
        use_shm = self.config.kv_use_shm and p.remote_host_id == self.host_id
        req = m.PullRequest(tid, load.remote_block_ids, self.compat, self.host_id, use_shm)
        self._send(peer, [m.PULL, m.encoder.encode(req)])

    def _fail(self, tid: str, error: str) -> None:
        p = self._pending.pop(tid, None)
        if p is not None:
            self.stats.loads_failed += 1
            self._emit(Event("failed", p.load.req_id, p.load, error=error))

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2 or frames[0].bytes != m.KV:
                continue
            try:
                head = m.header_decoder.decode(frames[1].buffer)
            except Exception:  # noqa: BLE001 - a malformed header is dropped like a late one
                continue
            p = self._pending.get(head.transfer_id)
            if p is None:  # late: the pull timed out, was cancelled or answered already
                self.stats.late_frames += 1
                self._thread_end.send(b"e")  # no event, but the count reaches /metrics
                continue
            if head.error is not None:
                self._fail(head.transfer_id, f"the prefill instance refused: {head.error}")
                continue
            data = frames[2:]
            if head.shm_path:
                if not is_staging_path(head.shm_path):
                    self._fail(head.transfer_id, "the prefill instance named a file that is not "
                                                 "a kvflow staging file")
                    continue
                try:
                    data = [self._mappings.view(head.shm_path, head.num_bytes)]
                except (OSError, ValueError) as e:
                    self._fail(head.transfer_id, f"shared memory: {e}")
                    continue
            del self._pending[head.transfer_id]
            # DONE goes once the engine has copied the bytes (release_remote(done=True)): a
            # staging file is reused after it
            self._emit(Event("loaded", p.load.req_id, p.load, data, head.num_bytes,
                             time.monotonic() - p.started, peer=p.peer))

    def _tick(self, now: float) -> None:
        for lease in self.leases.expired(now):
            self.stats.leases_expired += 1
            logger.warning("kvflow: KV lease %s expired (no word from a decode instance for "
                           "%.0fs): its %d blocks are freed", lease.transfer_id,
                           self.leases.timeout_s, len(lease.block_ids))
            self._end_lease(lease, "expired")
        for tid, p in list(self._pending.items()):
            if now >= p.deadline:
                self._send(p.peer, [m.RELEASE, m.encoder.encode(tid)])
                self._fail(tid, f"no answer from the prefill instance at {p.peer[0]}:{p.peer[1]} "
                                f"in {self.config.kv_load_timeout_s:g}s")
            elif now >= p.next_beat:
                p.next_beat = now + self.config.kv_lease_timeout_s / 3
                self._send(p.peer, [m.BEAT, m.encoder.encode(tid)])
        for tid, w in self._watched.items():
            if now >= w[1]:
                w[1] = now + self.config.kv_lease_timeout_s / 3
                self._send(w[0], [m.BEAT, m.encoder.encode(tid)])

    def _end_lease(self, lease, reason: str) -> None:
        # pulls are served on this thread and copy the blocks out before they are sent, so no
        # read of the lease's blocks is under way: the engine may free them at once
        if self._staging is not None:
            self._staging.give_back(lease.transfer_id)
        self._emit(Event("released", lease.transfer_id, error=reason))

    # -- serving pulls (prefill side) --------------------------------------------------------
    def _serve(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            ident, kind, payload = frames[0].bytes, frames[1].bytes, frames[2].buffer
            try:
                if kind == m.PULL:
                    self._serve_pull(router, ident, m.pull_decoder.decode(payload))
                elif kind == m.BEAT:
                    self.leases.extend(m.str_decoder.decode(payload), time.monotonic())
                elif kind in (m.DONE, m.RELEASE):
                    lease = self.leases.pop(m.str_decoder.decode(payload))
                    if lease is not None:
                        self.stats.leases_released += 1
                        self._end_lease(lease, "done" if kind == m.DONE else "released")
            except zmq.ZMQError as e:  # the peer went away before the answer: its loss
                logger.warning("kvflow: KV transfer to a decode instance failed: %s", e)
            except Exception as e:  # noqa: BLE001 - a hostile or broken peer's message
                logger.warning("kvflow: bad KV-transfer message dropped: %s", e)

    def _serve_pull(self, router: zmq.Socket, ident: bytes, req: m.PullRequest) -> None:
        def refuse(error: str) -> None:
            router.send_multipart([ident, m.KV, m.encoder.encode(m.KVHeader(req.transfer_id, error))])

        lease = self.leases.get(req.transfer_id)
        if lease is None:
            return refuse(f"no lease {req.transfer_id!r} (expired, released or never granted)")
        diff = compat_mismatch(self.compat, req.compat)
        if diff is not None:
            return refuse(f"incompatible KV cache: {diff}")
        held = set(lease.block_ids)
        if not all(b in held for b in req.block_ids):
            return refuse("block ids outside the lease")
        self.leases.extend(req.transfer_id, time.monotonic())
        _, total = transfer_bytes(self.kv, len(req.block_ids))
        staging = None
        if (req.use_shm and req.host_id == self.host_id and self._staging is not None
                and req.transfer_id not in self._staging.in_use):
            staging = self._staging.take(req.transfer_id, total)
        if staging is not None:
            gather_into(self.kv, req.block_ids, staging.tensor)
            header = m.KVHeader(req.transfer_id, shm_path=staging.path, num_bytes=total)
            router.send_multipart([ident, m.KV, m.encoder.encode(header)])
        else:
            parts = gather_frames(self.kv, req.block_ids)
            header = m.KVHeader(req.transfer_id, num_bytes=total)
            router.send_multipart([ident, m.KV, m.encoder.encode(header), *parts], copy=False)
        self.stats.pulls_served += 1
        self.stats.bytes_sent += total
        self.stats.blocks_sent += len(req.block_ids)


def write_blocks(kv: PagedKV, event: Event) -> None:
    """Copy a finished pull's bytes into this engine's cache blocks (the engine thread, between
    steps: no rank is running, so none reads or writes the cache meanwhile): block for block,
    or token by token where the prefill instance's block size is not this one's."""
    ld = event.load
    if ld.params.remote_block_size == kv.block_shape[1]:
        scatter(kv, ld.local_block_ids, event.frames)
    else:
        scatter_tokens(kv, event.frames, ld.params.remote_block_size, len(ld.remote_block_ids),
                       ld.local_block_ids, ld.first_token, ld.num_tokens)
