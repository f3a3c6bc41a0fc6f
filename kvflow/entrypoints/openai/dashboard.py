"""The live dashboard: `GET /dashboard` (one static page) and `GET /dashboard/stream` (server-sent
events with the engine's latest snapshot and the last minute's request latencies).

The core makes snapshots only while somebody watches: the first stream to open switches them
on, the last to close switches them off. Like /metrics, these routes need no API key; they show
request ids and token counts, never text. Which blocks are shared (a request's prefix-cache
hit) is shown only with --enable-prompt-tokens-details: otherwise a tenant could see whether
another tenant's prompt is cached. The aggregate counts (cached-free blocks) stay.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque

import msgspec
import msgspec.structs
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from kvflow.engine.async_engine import StatLogger
from kvflow.engine.protocol import HELD, SHARED, EngineSnapshot, KVTransferStats
from kvflow.outputs import RequestOutput

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/stream",
                             *(f"/dashboard/{name}" for name in STATIC_FILES)})
STREAM_INTERVAL_S = 0.25  # push at most 4 times a second
KEEPALIVE_S = 15.0  # an SSE comment while nothing changes keeps proxies from closing the stream
LATENCY_WINDOW_S = 60.0


class RecentLatencies(StatLogger):
    """TTFT and mean inter-token latency of each request that finished in the last minute,
    measured where the client sees them (the frontend), like the /metrics histograms."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_kept: int = 4096) -> None:
        self.window_s = window_s
        self.finished: deque[tuple[float, float, float | None]] = deque(maxlen=max_kept)
        self._live: dict[str, list[float]] = {}  # id -> [ttft, first token time, last, deltas]
        self.version = 0  # bumped on every finish, so the stream knows when to resend

    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if any(c.token_ids for c in out.outputs):
                if live is None:
                    arrival = out.metrics.get("arrival_time") or now
                    live = self._live[out.request_id] = [max(0.0, now - arrival), now, now, 1]
                else:
                    live[2], live[3] = now, live[3] + 1
            if out.finished and live is not None:
                del self._live[out.request_id]
                ttft, first, last, deltas = live
                itl = (last - first) / (deltas - 1) if deltas > 1 else None
                self.finished.append((now, ttft, itl))
                self.version += 1

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def last_minute(self, now: float) -> list[tuple[float, float, float | None]]:
        """(finish time, ttft, mean itl) per request finished within the window, oldest first."""
        while self.finished and now - self.finished[0][0] > self.window_s:
            self.finished.popleft()
        return list(self.finished)


def hide_sharing(snapshot: EngineSnapshot) -> EngineSnapshot:
    """The snapshot with shared blocks shown as merely held (no per-request cache hits)."""
    owners = [HELD if o == SHARED else o for o in snapshot.block_owners]
    return msgspec.structs.replace(snapshot, block_owners=owners)


def transfer_view(kt: KVTransferStats | None) -> dict | None:
    """Prefill/decode transfers for the page, both sides (an instance shows the side it plays;
    the other stays at zero): counts since start, what is in flight, blocks and bytes moved and
    the mean pull latency (only the decode side times its pulls). None without
    --kv-transfer-config."""
    if kt is None:
        return None
    return {
        "prefill": {"leases_active": kt.leases_active, "leases_granted": kt.leases_granted,
                    "leases_released": kt.leases_released, "leases_expired": kt.leases_expired,
                    "pulls_served": kt.pulls_served, "blocks_sent": kt.blocks_sent,
                    "bytes_sent": kt.bytes_sent},
        "decode": {"loads_active": kt.loads_active, "loads_done": kt.loads_done,
                   "loads_failed": kt.loads_failed, "blocks_received": kt.blocks_received,
                   "bytes_received": kt.bytes_received, "late_frames": kt.late_frames,
                   "mean_load_s": kt.load_seconds / kt.loads_done if kt.loads_done else None},
    }


def dashboard_event(engine, snapshot, latencies: RecentLatencies, model_name: str,
                    now: float) -> dict:
    """One stream event's body: the snapshot as viewers may see it, the last minute's
    latencies and the transfer counts of the engine's latest stats."""
    info = engine.info
    return {"time": now, "model": model_name,
            "max_model_len": info.max_model_len if info else None,
            "engine_dead": engine.is_dead, "snapshot": snapshot,
            "latencies": latencies.last_minute(now),
            "kv_transfer": transfer_view(engine.last_stats.kv_transfer)}


class Viewers:
    """Counts open streams; tells the engine to make snapshots while there is at least one."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.count = 0

    def __enter__(self) -> Viewers:
        self.count += 1
        if self.count == 1:
            self.engine.enable_snapshots(True)
        return self

    def __exit__(self, *exc) -> None:
        self.count -= 1
        if self.count == 0 and not self.engine.is_dead:
            self.engine.enable_snapshots(False)


def dashboard_router(engine, latencies: RecentLatencies, settings) -> APIRouter:
    """Routes of the dashboard. `engine` is the AsyncLLM (its `snapshot` is the latest the
    core sent); `settings.shutting_down` ends the streams."""
    router = APIRouter()
    viewers = Viewers(engine)
    encoder = msgspec.json.Encoder()

    @router.get("/dashboard", include_in_schema=False)
    async def page():
        return FileResponse(os.path.join(STATIC_DIR, "dashboard.html"), media_type="text/html")

    shown: list = [None, None]  # the last snapshot and what viewers see of it, made once for all

    def visible(snapshot):
        if snapshot is None or settings.enable_prompt_tokens_details:
            return snapshot
        if shown[0] is not snapshot:
            shown[:] = [snapshot, hide_sharing(snapshot)]
        return shown[1]

    def event(snapshot) -> bytes:
        body = dashboard_event(engine, visible(snapshot), latencies, settings.model_name,
                               time.time())
        return b"data: " + encoder.encode(body) + b"\n\n"

    async def stream(request: Request):
        with viewers:
            sent, sent_version, sent_kt = object(), -1, object()
            quiet_since = time.monotonic()
            yield b"retry: 1000\n\n"
            while not settings.shutting_down and not await request.is_disconnected():
                snap, kt = engine.snapshot, engine.last_stats.kv_transfer
                # transfer counts may move while the snapshot does not (or none is made)
                if snap is not sent or latencies.version != sent_version or kt != sent_kt:
                    sent, sent_version, sent_kt = snap, latencies.version, kt
                    quiet_since = time.monotonic()
                    yield event(snap)
                elif time.monotonic() - quiet_since > KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield b": keepalive\n\n"
                await asyncio.sleep(STREAM_INTERVAL_S)

    @router.get("/dashboard/stream", include_in_schema=False)
    async def events(request: Request):
        return StreamingResponse(stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # after /dashboard/stream, which this pattern would otherwise swallow
    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in STATIC_FILES:
            return Response(status_code=404)
        return FileResponse(os.path.join(STATIC_DIR, name), media_type=STATIC_FILES[name])

    return router
