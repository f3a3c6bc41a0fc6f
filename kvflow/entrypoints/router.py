"""`kvflow router`: one OpenAI-compatible front for several `kvflow serve` instances.

With `--prefill URL... --decode URL...` it disaggregates (vLLM's proxy flow): each request goes
first to a prefill instance with `max_tokens=1` and `kv_transfer_params: {"do_remote_decode":
true}`; that instance computes the prompt and lends its KV blocks, answering where they are; the
original request then goes, with those `kv_transfer_params`, to a decode instance, which pulls the
blocks and streams the answer. With `--replicas URL...` it load-balances plain instances.

Instances are picked by load (requests in flight through this router), and among the least
loaded by the prompt's start (prefix affinity: the same system prompt meets its cached blocks).
A prefill instance that fails (unreachable, 5xx) is retried on another before the client sees an
error. The router holds no model and no KV: it only moves JSON and SSE bytes."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

AFFINITY_SLACK = 1  # a backend at most this many requests above the least loaded may win by prefix
MAX_BODY_BYTES = 32 * 2**20
PREFILL_HEADER = "x-kvflow-prefill-ms"  # on a disaggregated answer: the prefill hop's time


@dataclass(eq=False)
class Backend:
    url: str
    role: str  # prefill | decode | replica
    inflight: int = 0
    healthy: bool = True


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": param,
                                   "code": status}}, status_code=status)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvflow_router:requests", "Requests by mode and outcome.",
                                ["mode", "outcome"], registry=r)
        self.backend_errors = Counter("kvflow_router:backend_errors",
                                      "Failed calls to a backend.", ["backend"], registry=r)
        self.prefill_retries = Counter("kvflow_router:prefill_retries",
                                       "Prefills retried on another instance.", registry=r)
        self.inflight = Gauge("kvflow_router:inflight", "Requests in flight per backend.",
                              ["backend"], registry=r)
        self.prefill_seconds = Histogram("kvflow_router:prefill_seconds",
                                         "Time of the prefill hop (PD mode).", registry=r)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], replicas: list[str],
                 timeout_s: float = 600.0) -> None:
        if replicas and (prefill or decode):
            raise ValueError("router: give --replicas, or --prefill and --decode, not both")
        if not replicas and not (prefill and decode):
            raise ValueError("router: give --prefill URL... and --decode URL..., or --replicas URL...")
        self.prefill = [Backend(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Backend(u.rstrip("/"), "decode") for u in decode]
        self.replicas = [Backend(u.rstrip("/"), "replica") for u in replicas]
        self.pd = bool(prefill)
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.metrics = RouterMetrics()

    @property
    def backends(self) -> list[Backend]:
        return self.prefill + self.decode + self.replicas

    def pick(self, pool: list[Backend], key: str, exclude: set = frozenset()) -> Backend | None:
        """The least loaded (healthy first); among those within AFFINITY_SLACK of it, the one
        the prompt's start hashes to."""
        live = [b for b in pool if b not in exclude]
        candidates = [b for b in live if b.healthy] or live
        if not candidates:
            return None
        low = min(b.inflight for b in candidates)
        near = [b for b in candidates if b.inflight <= low + AFFINITY_SLACK]
        h = int.from_bytes(hashlib.sha256(key.encode("utf-8", "replace")).digest()[:4], "big")
        return near[h % len(near)]

    def _headers(self, raw: Request) -> dict:
        auth = raw.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def _post(self, b: Backend, path: str, body: dict, headers: dict) -> httpx.Response:
        b.inflight += 1
        self.metrics.inflight.labels(b.url).set(b.inflight)
        try:
            return await self.client.post(b.url + path, json=body, headers=headers)
        finally:
            b.inflight -= 1
            self.metrics.inflight.labels(b.url).set(b.inflight)

    async def _forward(self, pool: list[Backend], path: str, body: dict, headers: dict,
                       key: str, mode: str, retry: bool, reply_headers: dict | None = None
                       ) -> Response:
        """Send `body` to an instance of `pool` and hand its answer (JSON, or the SSE stream)
        back, with `reply_headers` added; before any byte reached the client, a failed instance
        is retried on another."""
        tried: set = set()
        while True:
            b = self.pick(pool, key, tried)
            if b is None:
                self.metrics.requests.labels(mode, "no_backend").inc()
                return error(503, f"router: no {pool[0].role} instance could take the request")
            tried.add(b)
            b.inflight += 1
            self.metrics.inflight.labels(b.url).set(b.inflight)
            try:
                req = self.client.build_request("POST", b.url + path, json=body, headers=headers)
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError:
                self._done(b)
                b.healthy = False
                self.metrics.backend_errors.labels(b.url).inc()
                if retry:
                    continue
                return error(502, f"router: {b.role} instance {b.url} is unreachable")
            if resp.status_code >= 500 and retry:
                await resp.aclose()
                self._done(b)
                self.metrics.backend_errors.labels(b.url).inc()
                continue
            self.metrics.requests.labels(mode, "ok" if resp.status_code < 400 else "error").inc()
            ctype = resp.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await resp.aread()
                finally:
                    await resp.aclose()
                    self._done(b)
                return Response(data, status_code=resp.status_code, media_type=ctype,
                                headers=reply_headers)
            return StreamingResponse(self._relay(b, resp), status_code=resp.status_code,
                                     media_type=ctype, headers=reply_headers)

    async def _relay(self, b: Backend, resp: httpx.Response):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:  # the client went away or the stream ended: the instance is told by the close
            await resp.aclose()
            self._done(b)

    def _done(self, b: Backend) -> None:
        b.inflight -= 1
        self.metrics.inflight.labels(b.url).set(b.inflight)

    async def handle(self, path: str, raw: Request) -> Response:
        """One client request; if the client leaves before the answer, the instances' calls are
        cancelled (closing their connections, which aborts the request there)."""
        task = asyncio.ensure_future(self._handle(path, raw))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.metrics.requests.labels("pd" if self.pd else "replicas", "client_gone").inc()
                return Response(status_code=499)

    async def _handle(self, path: str, raw: Request) -> Response:
        data = await raw.body()
        if len(data) > MAX_BODY_BYTES:
            return error(413, f"router: request body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"router: the body is not JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "router: the body must be a JSON object")
        if "kv_transfer_params" in body:
            return error(400, "kv_transfer_params: set by the router, not by clients",
                         "kv_transfer_params")
        key = json.dumps(body.get("prompt", body.get("messages", "")))[:512]
        headers = self._headers(raw)
        if not self.pd:
            return await self._forward(self.replicas, path, body, headers, key, "replicas", True)
        if body.get("n", 1) != 1:
            return error(400, "n: the router disaggregates one sample per request (n=1)", "n")
        prefill_body = {k: v for k, v in body.items()
                        if k not in ("stream", "stream_options", "max_completion_tokens")}
        prefill_body.update(max_tokens=1, min_tokens=0, stream=False,
                            kv_transfer_params={"do_remote_decode": True})
        t0 = time.perf_counter()
        tried: set = set()
        while True:
            b = self.pick(self.prefill, key, tried)
            if b is None:
                self.metrics.requests.labels("pd", "no_prefill").inc()
                return error(503, "router: no prefill instance could take the request")
            tried.add(b)
            try:
                resp = await self._post(b, path, prefill_body, headers)
            except httpx.TransportError:
                resp = None
            if resp is not None and resp.status_code < 500:
                break
            b.healthy = resp is not None and b.healthy
            self.metrics.backend_errors.labels(b.url).inc()
            self.metrics.prefill_retries.inc()
        prefill_s = time.perf_counter() - t0
        self.metrics.prefill_seconds.observe(prefill_s)
        if resp.status_code != 200:  # the client's error (a 4xx): as the instance said it
            self.metrics.requests.labels("pd", "error").inc()
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        params = resp.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            self.metrics.requests.labels("pd", "error").inc()
            return error(502, f"router: prefill instance {b.url} returned no kv_transfer_params "
                              "(is it started with --kv-transfer-config kv_producer?)")
        # the prefill hop (queue and prompt on the prefill instance, until its kv_transfer_params
        # came back), for clients that break their TTFT down
        return await self._forward(self.decode, path, dict(body, kv_transfer_params=params),
                                   headers, key, "pd", False,
                                   {PREFILL_HEADER: f"{prefill_s * 1e3:.3f}"})

    async def health(self) -> Response:
        async def probe(b: Backend) -> None:
            try:
                r = await self.client.get(b.url + "/health", timeout=3.0)
                b.healthy = r.status_code == 200
            except httpx.HTTPError:
                b.healthy = False

        await asyncio.gather(*(probe(b) for b in self.backends))
        status = {b.url: {"role": b.role, "healthy": b.healthy, "inflight": b.inflight}
                  for b in self.backends}
        pools = [self.prefill, self.decode] if self.pd else [self.replicas]
        ok = all(any(b.healthy for b in pool) for pool in pools)
        return JSONResponse({"healthy": ok, "backends": status}, status_code=200 if ok else 503)

    async def models(self, raw: Request) -> Response:
        for b in (self.decode or self.replicas):
            try:
                r = await self.client.get(b.url + "/v1/models", headers=self._headers(raw))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return error(503, "router: no instance answers /v1/models")


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvflow router")

    @app.on_event("startup")
    async def _start() -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        router.client = httpx.AsyncClient(timeout=router.timeout, limits=limits)

    @app.on_event("shutdown")
    async def _stop() -> None:
        await router.client.aclose()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await router.handle("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await router.handle("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await router.models(raw)

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type="text/plain")

    return app


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        router = Router(args.prefill or [], args.decode or [], args.replicas or [], args.timeout)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


def register(sub) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible front for prefill/decode instances "
                                      "or plain replicas")
    p.add_argument("--prefill", nargs="+", metavar="URL", help="prefill (kv_producer) instances")
    p.add_argument("--decode", nargs="+", metavar="URL", help="decode (kv_consumer) instances")
    p.add_argument("--replicas", nargs="+", metavar="URL", help="plain instances to balance")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one backend call")
    p.set_defaults(func=cmd_router)
