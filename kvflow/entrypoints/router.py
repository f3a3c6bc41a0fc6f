"""`kvflow router`: one OpenAI-compatible front for several `kvflow serve` instances.

With `--prefill URL... --decode URL...` it disaggregates (vLLM's proxy flow): each request goes
first to a prefill instance with `max_tokens=1` and `kv_transfer_params: {"do_remote_decode":
true}`; that instance computes the prompt and lends its KV blocks, answering where they are; the
original request then goes, with those `kv_transfer_params`, to a decode instance, which pulls the
blocks and streams the answer. With `--replicas URL...` it load-balances plain instances.

Replicas (and prefill instances) are picked by `--policy` (kvflow/core/routing.py), by default
SGLang router's cache-aware one over an approximate tree of the prompts' text each was sent;
load is requests in flight through this router. A replica that fails before any token reached
the client (unreachable, a 5xx, a stream cut before its first token) is retried once on another.
Workers join and leave at run time (kvflow/entrypoints/router_workers.py). The router holds no
model and no KV: it only moves JSON and SSE bytes."""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.core.routing import POLICIES, CacheAwareConfig, make_policy
from kvflow.entrypoints.router_workers import Backend, HealthConfig, Workers

MAX_BODY_BYTES = 32 * 2**20
MAX_KEY_CHARS = 65536  # of a prompt's text, for the cache-aware tree
MAX_HELD_BYTES = 2**20  # a stream's bytes held back until its first token (then it is relayed)
PREFILL_HEADER = "x-kvflow-prefill-ms"  # on a disaggregated answer: the prefill hop's time


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": param,
                                   "code": status}}, status_code=status)


def prompt_text(body: dict) -> str:
    """The text the cache-aware tree routes by: the prompt, or the chat's roles and contents in
    order (what the chat template will wrap), cut at MAX_KEY_CHARS; after the `cache_salt`, if
    any (requests with different salts never share cached blocks)."""
    salt = body.get("cache_salt")
    text = _prompt_text(body)
    return f"{salt}\x00{text}"[:MAX_KEY_CHARS] if isinstance(salt, str) and salt else text


def _prompt_text(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch goes to one replica: route by its first prompt
    if isinstance(prompt, str):
        return prompt[:MAX_KEY_CHARS]
    if prompt is not None:
        return json.dumps(prompt)[:MAX_KEY_CHARS]  # token ids, as text
    parts: list[str] = []
    size = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and isinstance(p.get("text"), str))
        piece = f"<{m.get('role')}>{content if isinstance(content, str) else ''}"
        parts.append(piece)
        size += len(piece)
        if size >= MAX_KEY_CHARS:
            break
    return "".join(parts)[:MAX_KEY_CHARS]


def first_token_seen(event: bytes) -> bool:
    """Whether one SSE event commits the stream: it carries text, a finish reason, an error or
    the end (a chat's first chunk, the role with empty content, does not)."""
    data = event.strip()
    if not data.startswith(b"data:"):
        return False  # a comment or keep-alive
    data = data[5:].strip()
    if data == b"[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        return True
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return True  # an error object, or the usage chunk
    for c in choices:
        if not isinstance(c, dict):
            return True
        delta = c.get("delta") or {}
        if c.get("text") or c.get("finish_reason") or c.get("logprobs") or any(
                v for k, v in delta.items() if k != "role"):
            return True
    return False


class StreamCutError(Exception):
    """The replica's stream ended or broke before its first token: safe to retry."""


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvflow_router:requests", "Requests by mode and outcome.",
                                ["mode", "outcome"], registry=r)
        self.routed = Counter("kvflow_router:backend_requests",
                              "Requests sent to each backend, by why the policy chose it.",
                              ["backend", "reason"], registry=r)
        self.backend_errors = Counter("kvflow_router:backend_errors",
                                      "Failed calls to a backend.", ["backend"], registry=r)
        self.retries = Counter("kvflow_router:retries",
                               "Requests retried on another replica before their first token.",
                               registry=r)
        self.prefill_retries = Counter("kvflow_router:prefill_retries",
                                       "Prefills retried on another instance.", registry=r)
        self.inflight = Gauge("kvflow_router:inflight", "Requests in flight per backend.",
                              ["backend"], registry=r)
        self.healthy = Gauge("kvflow_router:backend_healthy",
                             "1 while a backend takes requests, 0 while it is out.",
                             ["backend", "role"], registry=r)
        self.prefill_seconds = Histogram("kvflow_router:prefill_seconds",
                                         "Time of the prefill hop (PD mode).", registry=r)

    def worker_changed(self, b: Backend, present: bool) -> None:
        if present:
            self.healthy.labels(b.url, b.role).set(1 if b.healthy else 0)
        else:
            self.healthy.remove(b.url, b.role)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], replicas: list[str],
                 timeout_s: float = 600.0, policy: str = "cache_aware",
                 cache: CacheAwareConfig | None = None, health: HealthConfig | None = None,
                 admin_api_key: str | None = None) -> None:
        if replicas and (prefill or decode):
            raise ValueError("router: give --replicas, or --prefill and --decode, not both")
        if not replicas and not (prefill and decode):
            raise ValueError("router: give --prefill URL... and --decode URL..., or --replicas URL...")
        self.pd = bool(prefill)
        cache = cache or CacheAwareConfig()
        if self.pd:  # the prompt is computed (and cached) on the prefill side
            pools = {"prefill": prefill, "decode": decode}
            policies = {"prefill": make_policy(policy, cache),
                        "decode": make_policy("least_load")}
        else:
            pools = {"replica": replicas}
            policies = {"replica": make_policy(policy, cache)}
        self.workers = Workers(pools, policies, health or HealthConfig())
        self.policy_name = policy
        self.admin_api_key = admin_api_key
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.metrics = RouterMetrics()
        self.workers.on_change = lambda b: self.metrics.worker_changed(
            b, self.workers.find(b.url) is b)
        for b in self.workers.all:
            self.metrics.worker_changed(b, True)
        self._checks: asyncio.Task | None = None

    @property
    def backends(self) -> list[Backend]:
        return self.workers.all

    def pool(self, role: str) -> list[Backend]:
        return self.workers.pools[role]

    def pick(self, role: str, key: str, exclude: set = frozenset()) -> Backend | None:
        """The policy's choice among the pool's healthy workers (all of them if none is)."""
        live = [b for b in self.pool(role) if b not in exclude]
        candidates = [b for b in live if b.healthy] or live
        if not candidates:
            return None
        policy = self.workers.policies[role]
        choice = policy.choose({b: b.inflight for b in candidates}, key)
        policy.routed(choice.replica, key)
        self.metrics.routed.labels(choice.replica.url, choice.reason).inc()
        return choice.replica

    def _headers(self, raw: Request) -> dict:
        auth = raw.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    def _count(self, b: Backend, delta: int) -> None:
        b.inflight += delta
        if self.workers.find(b.url) is b:  # a removed worker's gauge stays removed
            self.metrics.inflight.labels(b.url).set(b.inflight)

    def _failed(self, b: Backend, unreachable: bool) -> None:
        self.metrics.backend_errors.labels(b.url).inc()
        if unreachable:
            self.workers.take_out(b)

    async def _post(self, b: Backend, path: str, body: dict, headers: dict) -> httpx.Response:
        self._count(b, 1)
        try:
            return await self.client.post(b.url + path, json=body, headers=headers)
        finally:
            self._count(b, -1)

    async def _forward(self, role: str, path: str, body: dict, headers: dict, key: str,
                       mode: str, retries: int, reply_headers: dict | None = None) -> Response:
        """Send `body` to a worker of `role` and hand its answer (JSON, or the SSE stream)
        back, with `reply_headers` added. A worker that fails before the answer's first token
        (unreachable, a 5xx, a stream cut before it) is retried on another, `retries` times."""
        tried: set = set()
        while True:
            b = self.pick(role, key, tried)
            if b is None:
                self.metrics.requests.labels(mode, "no_backend").inc()
                return error(503, f"router: no {role} instance could take the request")
            tried.add(b)
            try:
                return await self._attempt(b, path, body, headers, mode, retries > 0,
                                           reply_headers)
            except (httpx.TransportError, StreamCutError) as e:
                self._failed(b, unreachable=True)
                if retries <= 0:
                    self.metrics.requests.labels(mode, "backend_failed").inc()
                    return error(502, f"router: {b.role} instance {b.url} failed: "
                                      f"{type(e).__name__}")
            except _Retry:
                self._failed(b, unreachable=False)
            retries -= 1
            self.metrics.retries.inc()

    async def _attempt(self, b: Backend, path: str, body: dict, headers: dict, mode: str,
                       may_retry: bool, reply_headers: dict | None) -> Response:
        """One try on `b`; raises (with nothing sent to the client) where a retry may follow."""
        self._count(b, 1)
        resp = None
        handed_over = False
        try:
            req = self.client.build_request("POST", b.url + path, json=body, headers=headers)
            resp = await self.client.send(req, stream=True)
            if resp.status_code >= 500 and may_retry:
                raise _Retry()
            ctype = resp.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                data = await resp.aread()
                self.metrics.requests.labels(
                    mode, "ok" if resp.status_code < 400 else "error").inc()
                return Response(data, status_code=resp.status_code, media_type=ctype,
                                headers=reply_headers)
            chunks = resp.aiter_raw()
            held = await self._hold_until_first_token(chunks) if may_retry else b""
            self.metrics.requests.labels(mode, "ok" if resp.status_code < 400 else "error").inc()
            handed_over = True
            return StreamingResponse(self._relay(b, resp, held, chunks),
                                     status_code=resp.status_code, media_type=ctype,
                                     headers=reply_headers)
        finally:
            if not handed_over:
                if resp is not None:
                    await resp.aclose()
                self._count(b, -1)

    @staticmethod
    async def _hold_until_first_token(chunks) -> bytes:
        """Read the stream until an event commits it (first_token_seen); what was read.
        StreamCutError if it ends first; past MAX_HELD_BYTES it is committed anyway."""
        buf = b""
        seen = 0  # how much of buf has been looked at for whole events
        async for chunk in chunks:
            buf += chunk
            while True:
                end = buf.find(b"\n\n", seen)
                if end < 0:
                    break
                if first_token_seen(buf[seen:end]):
                    return buf
                seen = end + 2
            if len(buf) > MAX_HELD_BYTES:
                return buf
        raise StreamCutError("the stream ended before its first token")

    async def _relay(self, b: Backend, resp: httpx.Response, held: bytes, chunks):
        try:
            if held:
                yield held
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError:
            self._failed(b, unreachable=True)  # cut mid-answer: the client sees it end early
        finally:  # the client went away or the stream ended: the instance is told by the close
            await resp.aclose()
            self._count(b, -1)

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
        key = prompt_text(body)
        headers = self._headers(raw)
        if not self.pd:
            return await self._forward("replica", path, body, headers, key, "replicas", 1)
        if body.get("n", 1) != 1:
            return error(400, "n: the router disaggregates one sample per request (n=1)", "n")
        prefill_body = {k: v for k, v in body.items()
                        if k not in ("stream", "stream_options", "max_completion_tokens")}
        prefill_body.update(max_tokens=1, min_tokens=0, stream=False,
                            kv_transfer_params={"do_remote_decode": True})
        t0 = time.perf_counter()
        tried: set = set()
        while True:
            b = self.pick("prefill", key, tried)
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
            self._failed(b, unreachable=resp is None)
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
        return await self._forward("decode", path, dict(body, kv_transfer_params=params),
                                   headers, key, "pd", 0,
                                   {PREFILL_HEADER: f"{prefill_s * 1e3:.3f}"})

    async def health(self) -> Response:
        """Probes every worker now; 200 while each needed pool has a healthy one."""
        await self.workers.probe_all()
        status = {b.url: {"role": b.role, "healthy": b.healthy, "inflight": b.inflight}
                  for b in self.backends}
        ok = all(any(b.healthy for b in pool) for pool in self.workers.pools.values())
        return JSONResponse({"healthy": ok, "backends": status}, status_code=200 if ok else 503)

    async def models(self, raw: Request) -> Response:
        pool = self.pool("decode" if self.pd else "replica")
        for b in sorted(pool, key=lambda b: not b.healthy):
            try:
                r = await self.client.get(b.url + "/v1/models", headers=self._headers(raw))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return error(503, "router: no instance answers /v1/models")

    # -- admin: workers join and leave -------------------------------------------------------
    def admin_refusal(self, raw: Request) -> Response | None:
        if self.admin_api_key is None:
            return None
        given = raw.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if hmac.compare_digest(token.encode(), self.admin_api_key.encode()):
            return None
        return JSONResponse({"error": {"message": "router: invalid or missing admin API key",
                                       "type": "invalid_request_error", "param": None,
                                       "code": 401}}, status_code=401)

    async def add_worker(self, url: str | None, role: str | None) -> Response:
        if role is None:
            if self.pd:
                return error(400, "role: give role=prefill or role=decode", "role")
            role = "replica"
        try:
            b = self.workers.add(url, role)
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            return error(400, f"router: {e}", param if param in ("url", "role") else None)
        # it takes requests as soon as it answers; until then the health checks watch it
        b.oks = self.workers.health.success_threshold - 1
        await self.workers.probe(b)
        return JSONResponse({"added": b.url, "role": b.role, "healthy": b.healthy})

    async def remove_worker(self, url: str | None) -> Response:
        b = self.workers.remove(url) if url else None
        if b is None:
            return error(404, f"router: {str(url)[:200]!r} is not a worker", "url")
        return JSONResponse({"removed": b.url, "role": b.role, "inflight": b.inflight})

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = self.workers.client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        if self.workers.health.interval_s > 0:
            self._checks = asyncio.create_task(self.workers.run_checks(), name="router-health")

    async def stop(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            await asyncio.gather(self._checks, return_exceptions=True)
        await self.client.aclose()


class _Retry(Exception):
    """A 5xx from a worker, before anything reached the client."""


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvflow router")

    @app.on_event("startup")
    async def _start() -> None:
        await router.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        await router.stop()

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

    @app.post("/add_worker")
    async def add_worker(raw: Request, url: str | None = None, role: str | None = None):
        return router.admin_refusal(raw) or await router.add_worker(url, role)

    @app.post("/remove_worker")
    async def remove_worker(raw: Request, url: str | None = None):
        return router.admin_refusal(raw) or await router.remove_worker(url)

    @app.get("/list_workers")
    async def list_workers(raw: Request):
        return router.admin_refusal(raw) or JSONResponse(
            dict(router.workers.listing(), policy=router.policy_name))

    return app


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        cache = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold,
                                 args.balance_rel_threshold, args.max_tree_size)
        health = HealthConfig(args.health_check_interval_secs, args.health_check_timeout_secs,
                              args.health_failure_threshold, args.health_success_threshold)
        router = Router(args.prefill or [], args.decode or [], args.replicas or [], args.timeout,
                        args.policy, cache, health, args.admin_api_key)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


def register(sub) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible front for prefill/decode instances "
                                      "or plain replicas (docs/data_parallel_and_routing.md)")
    p.add_argument("--prefill", nargs="+", metavar="URL", help="prefill (kv_producer) instances")
    p.add_argument("--decode", nargs="+", metavar="URL", help="decode (kv_consumer) instances")
    p.add_argument("--replicas", nargs="+", metavar="URL", help="plain instances to balance")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one backend call")
    d = CacheAwareConfig()
    g = p.add_argument_group("routing (SGLang router's names)")
    g.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="how a replica (or prefill instance) is chosen (default: cache_aware)")
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: the longest match must cover more than this fraction of "
                        f"the prompt to decide (default: {d.cache_threshold})")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: go to the least loaded when max - min in-flight requests "
                        f"exceeds this ... (default: {d.balance_abs_threshold})")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and max exceeds this times min (default: "
                        f"{d.balance_rel_threshold})")
    g.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="cache_aware: characters remembered per replica, LRU beyond (default: "
                        f"{d.max_tree_size})")
    h = HealthConfig()
    g = p.add_argument_group("workers")
    g.add_argument("--health-check-interval-secs", type=float, default=h.interval_s,
                   help=f"probe every worker's /health this often, 0: never (default: "
                        f"{h.interval_s:g})")
    g.add_argument("--health-check-timeout-secs", type=float, default=h.timeout_s,
                   help=f"a probe unanswered this long failed (default: {h.timeout_s:g})")
    g.add_argument("--health-failure-threshold", type=int, default=h.failure_threshold,
                   help="failed probes in a row that take a worker out (default: "
                        f"{h.failure_threshold})")
    g.add_argument("--health-success-threshold", type=int, default=h.success_threshold,
                   help="answered probes in a row that take it back (default: "
                        f"{h.success_threshold})")
    g.add_argument("--admin-api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /add_worker, /remove_worker and "
                        "/list_workers (default: open, as the router listens on 127.0.0.1)")
    p.set_defaults(func=cmd_router)
