"""`kvflow router`: one OpenAI-compatible front for several `kvflow serve` instances.

With `--prefill URL... --decode URL...` it disaggregates (vLLM's proxy flow): each request goes
first to a prefill instance with `max_tokens=1` and `kv_transfer_params: {"do_remote_decode":
true}`; that instance computes the prompt and lends its KV blocks, answering where they are; the
original request then goes, with those `kv_transfer_params`, to a decode instance, which pulls the
blocks and streams the answer. With `--replicas URL...` it load-balances plain instances.

Every endpoint of `kvflow serve` goes through (kvflow/entrypoints/router_endpoints.py says where
each goes): completions, chat, embeddings and Anthropic's messages by the policy; the Responses
API to the replica that stored a `previous_response_id`; tokenize to any one; LoRA load and
unload to every worker.

Replicas (and prefill instances) are picked by `--policy` (kvflow/core/routing.py), by default
SGLang router's cache-aware one over an approximate tree of the prompts' text each was sent;
with `--kv-events-endpoints`, over the blocks each replica's prefix cache really holds, as its
KV events say (kvflow/entrypoints/router_kv_events.py); load is requests in flight through this
router. A replica that fails before any token reached the client (unreachable, a 5xx, a stream
cut before its first token) is retried once on another.
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
from kvflow.entrypoints.router_endpoints import (ANTHROPIC_PREFIX, ANY_WORKER, FAN_OUT, NOT_IN_PD,
                                                 PREAMBLE_EVENTS, RESPONSES, FanOut,
                                                 ResponseHomes, ResponseIdScan, check_response_id,
                                                 error, stored_path)
from kvflow.entrypoints.router_kv_events import KVEventRouting, check_endpoint
from kvflow.entrypoints.router_workers import Backend, HealthConfig, Workers

MAX_BODY_BYTES = 32 * 2**20
MAX_KEY_CHARS = 65536  # of a prompt's text, for the cache-aware tree
MAX_HELD_BYTES = 2**20  # a stream's bytes held back until its first token (then it is relayed)
PREFILL_HEADER = "x-kvflow-prefill-ms"  # on a disaggregated answer: the prefill hop's time


def prompt_text(body: dict) -> str:
    """The text the cache-aware tree routes by: the prompt, or the chat's roles and contents in
    order (what the chat template will wrap), cut at MAX_KEY_CHARS; after the `cache_salt`, if
    any (requests with different salts never share cached blocks)."""
    salt = body.get("cache_salt")
    text = _prompt_text(body)
    return f"{salt}\x00{text}"[:MAX_KEY_CHARS] if isinstance(salt, str) and salt else text


def _prompt_text(body: dict) -> str:
    # completions' prompt, embeddings' and the Responses API's input, or chat messages
    prompt = body.get("prompt", body.get("input"))
    messages = body.get("messages")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt, messages = None, prompt  # Responses input items: messages and more
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch goes to one replica: route by its first prompt
    system = body.get("instructions", body.get("system"))  # Responses', Anthropic's
    head = f"<system>{_content_text(system)}" if system else ""
    if isinstance(prompt, str):
        return (head + prompt)[:MAX_KEY_CHARS]
    if prompt is not None:
        return json.dumps(prompt)[:MAX_KEY_CHARS]  # token ids, as text
    parts: list[str] = [head]
    size = len(head)
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        piece = f"<{m.get('role')}>{_content_text(m.get('content'))}"
        parts.append(piece)
        size += len(piece)
        if size >= MAX_KEY_CHARS:
            break
    return "".join(parts)[:MAX_KEY_CHARS]


def _content_text(content) -> str:
    """A message's text: a string, or the text of its parts (OpenAI's, Anthropic's blocks)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content[:256]
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def first_token_seen(event: bytes) -> bool:
    """Whether one SSE event commits the stream: it carries text, a finish reason, an error or
    the end (a chat's first chunk, the role with empty content, does not; nor do the Responses
    and Messages APIs' opening events, PREAMBLE_EVENTS)."""
    data = next((line[5:].strip() for line in event.strip().split(b"\n")
                 if line.startswith(b"data:")), None)
    if data is None:
        return False  # a comment or keep-alive
    if data == b"[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        return True
    if isinstance(chunk, dict) and "type" in chunk and "choices" not in chunk:
        return chunk["type"] not in PREAMBLE_EVENTS  # a Responses or Messages API event
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
                 admin_api_key: str | None = None, kv_events_endpoints: list[str] | None = None,
                 kv_events_topic: str = "") -> None:
        if replicas and (prefill or decode):
            raise ValueError("router: give --replicas, or --prefill and --decode, not both")
        if not replicas and not (prefill and decode):
            raise ValueError("router: give --prefill URL... and --decode URL..., or --replicas URL...")
        self.pd = bool(prefill)
        cache = cache or CacheAwareConfig()
        # the pool whose prefix caches matter: where prompts are computed
        self.cached_role = "prefill" if self.pd else "replica"
        cached_pool = prefill if self.pd else replicas
        endpoints = [check_endpoint(e, "kv_events_endpoints") for e in kv_events_endpoints or ()]
        if endpoints and len(endpoints) != len(cached_pool):
            flag = "--prefill" if self.pd else "--replicas"
            raise ValueError(f"kv_events_endpoints: give one per {flag} URL, in the same order "
                             f"({len(cached_pool)}), got {len(endpoints)}")
        self.kv_events = KVEventRouting(kv_events_topic) if endpoints else None
        blocks = self.kv_events.index if self.kv_events else None
        if self.pd:  # the prompt is computed (and cached) on the prefill side
            pools = {"prefill": prefill, "decode": decode}
            policies = {"prefill": make_policy(policy, cache, blocks=blocks),
                        "decode": make_policy("least_load")}
        else:
            pools = {"replica": replicas}
            policies = {"replica": make_policy(policy, cache, blocks=blocks)}
        self.workers = Workers(pools, policies, health or HealthConfig())
        for b, endpoint in zip(self.workers.pools[self.cached_role], endpoints):
            b.kv_events_endpoint = endpoint
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
        self.homes = ResponseHomes()  # response id -> the replica that stored it

    @property
    def backends(self) -> list[Backend]:
        return self.workers.all

    def pool(self, role: str) -> list[Backend]:
        return self.workers.pools[role]

    def pick(self, role: str, key: str, exclude: set = frozenset(),
             hashes: list[bytes] | None = None) -> Backend | None:
        """The policy's choice among the pool's healthy workers (all of them if none is);
        `hashes`: the prompt's block hashes, where the replicas' KV events are followed."""
        live = [b for b in self.pool(role) if b not in exclude]
        candidates = [b for b in live if b.healthy] or live
        if not candidates:
            return None
        policy = self.workers.policies[role]
        choice = policy.choose({b: b.inflight for b in candidates}, key, hashes)
        policy.routed(choice.replica, key)
        self.metrics.routed.labels(choice.replica.url, choice.reason).inc()
        return choice.replica

    def _headers(self, raw: Request) -> dict:
        # the client's credentials (OpenAI's or Anthropic's header) and Anthropic's version
        return {k: v for k in ("authorization", "x-api-key", "anthropic-version")
                if (v := raw.headers.get(k))}

    def pick_any(self, role: str | None = None) -> Backend | None:
        """The least busy worker (healthy first) for a request that any may answer; not a
        routing decision, so the policy does not learn from it."""
        pool = self.pool(role) if role else self.backends
        return min(pool, key=lambda b: (not b.healthy, b.inflight), default=None)

    def _count(self, b: Backend, delta: int, hashes: list[bytes] | None = None) -> None:
        """A request started (+1) or ended (-1) on `b`; with KV events followed, its prompt's
        blocks count as `b`'s while it runs (block_index.py)."""
        if hashes and self.kv_events is not None:
            self.kv_events.index.running(b, hashes, delta)
        b.inflight += delta
        if self.workers.find(b.url) is b:  # a removed worker's gauge stays removed
            self.metrics.inflight.labels(b.url).set(b.inflight)

    def _failed(self, b: Backend, unreachable: bool) -> None:
        self.metrics.backend_errors.labels(b.url).inc()
        if unreachable:
            self.workers.take_out(b)

    async def _post(self, b: Backend, path: str, body: dict, headers: dict,
                    hashes: list[bytes] | None = None) -> httpx.Response:
        self._count(b, 1, hashes)
        try:
            return await self.client.post(b.url + path, json=body, headers=headers)
        finally:
            self._count(b, -1, hashes)

    async def _forward(self, role: str, path: str, body: dict, headers: dict, key: str,
                       mode: str, retries: int, reply_headers: dict | None = None,
                       pinned: Backend | None = None, on_id=None,
                       hashes: list[bytes] | None = None) -> Response:
        """Send `body` to a worker of `role` (or to `pinned`, no retry) and hand its answer
        (JSON, or the SSE stream) back, with `reply_headers` added. A worker that fails before
        the answer's first token (unreachable, a 5xx, a stream cut before it) is retried on
        another, `retries` times. `on_id(id, worker)`: called with a Responses API answer's id."""
        tried: set = set()
        if pinned is not None:
            retries = 0
        while True:
            b = pinned or self.pick(role, key, tried, hashes)
            if b is None:
                self.metrics.requests.labels(mode, "no_backend").inc()
                return error(503, f"router: no {role} instance could take the request",
                             path=path)
            tried.add(b)
            try:
                return await self._attempt(b, path, body, headers, mode, retries > 0,
                                           reply_headers, on_id, hashes)
            except (httpx.TransportError, StreamCutError) as e:
                self._failed(b, unreachable=True)
                if retries <= 0:
                    self.metrics.requests.labels(mode, "backend_failed").inc()
                    return error(502, f"router: {b.role} instance {b.url} failed: "
                                      f"{type(e).__name__}", path=path)
            except _Retry:
                self._failed(b, unreachable=False)
            retries -= 1
            self.metrics.retries.inc()

    async def _attempt(self, b: Backend, path: str, body: dict, headers: dict, mode: str,
                       may_retry: bool, reply_headers: dict | None, on_id=None,
                       hashes: list[bytes] | None = None) -> Response:
        """One try on `b`; raises (with nothing sent to the client) where a retry may follow."""
        self._count(b, 1, hashes)
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
                if on_id is not None and resp.status_code == 200:
                    rid = _json_id(data)
                    if rid is not None:
                        on_id(rid, b)
                return Response(data, status_code=resp.status_code, media_type=ctype,
                                headers=reply_headers)
            chunks = resp.aiter_raw()
            held = await self._hold_until_first_token(chunks) if may_retry else b""
            self.metrics.requests.labels(mode, "ok" if resp.status_code < 400 else "error").inc()
            handed_over = True
            scan = ResponseIdScan(lambda rid: on_id(rid, b)) if on_id is not None else None
            return StreamingResponse(self._relay(b, resp, held, chunks, scan, hashes),
                                     status_code=resp.status_code, media_type=ctype,
                                     headers=reply_headers)
        finally:
            if not handed_over:
                if resp is not None:
                    await resp.aclose()
                self._count(b, -1, hashes)

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

    async def _relay(self, b: Backend, resp: httpx.Response, held: bytes, chunks,
                     scan: ResponseIdScan | None = None, hashes: list[bytes] | None = None):
        try:
            if held:
                if scan is not None:
                    scan.feed(held)
                yield held
            async for chunk in chunks:
                if scan is not None:
                    scan.feed(chunk)
                yield chunk
        except httpx.TransportError:
            self._failed(b, unreachable=True)  # cut mid-answer: the client sees it end early
        finally:  # the client went away or the stream ended: the instance is told by the close
            await resp.aclose()
            self._count(b, -1, hashes)

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

    async def _body(self, path: str, raw: Request) -> dict | Response:
        """The request's JSON object, or the error that answers it."""
        data = await raw.body()
        if len(data) > MAX_BODY_BYTES:
            return error(413, f"router: request body over {MAX_BODY_BYTES} bytes", path=path)
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"router: the body is not JSON: {e}", path=path)
        if not isinstance(body, dict):
            return error(400, "router: the body must be a JSON object", path=path)
        if "kv_transfer_params" in body:
            return error(400, "kv_transfer_params: set by the router, not by clients",
                         "kv_transfer_params", path=path)
        return body

    async def _handle(self, path: str, raw: Request) -> Response:
        if self.pd and path in NOT_IN_PD:
            return self._not_in_pd(path)
        body = await self._body(path, raw)
        if isinstance(body, Response):
            return body
        headers = self._headers(raw)
        mode = "pd" if self.pd else "replicas"
        if path in ANY_WORKER:
            b = self.pick_any()
            if b is None:
                return error(503, "router: no worker", path=path)
            self.metrics.routed.labels(b.url, "any").inc()
            return await self._forward(b.role, path, body, headers, "", mode, 0, pinned=b)
        key = prompt_text(body)
        if path == RESPONSES:
            return await self._response(body, headers, key)
        hashes = await self._block_hashes(path, body, headers)
        if not self.pd:
            return await self._forward("replica", path, body, headers, key, "replicas", 1,
                                       hashes=hashes)
        if path == "/v1/embeddings":  # a prompt only: where prompts are computed
            return await self._forward("prefill", path, body, headers, key, "pd", 1)
        if body.get("n", 1) != 1:
            return error(400, "n: the router disaggregates one sample per request (n=1)", "n")
        prefill_body = {k: v for k, v in body.items()
                        if k not in ("stream", "stream_options", "max_completion_tokens")}
        prefill_body.update(max_tokens=1, min_tokens=0, stream=False,
                            kv_transfer_params={"do_remote_decode": True})
        t0 = time.perf_counter()
        tried: set = set()
        while True:
            b = self.pick("prefill", key, tried, hashes)
            if b is None:
                self.metrics.requests.labels("pd", "no_prefill").inc()
                return error(503, "router: no prefill instance could take the request")
            tried.add(b)
            try:
                resp = await self._post(b, path, prefill_body, headers, hashes)
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

    async def _block_hashes(self, path: str, body: dict, headers: dict) -> list[bytes] | None:
        """The prompt's block hashes where KV events are followed (router_kv_events.py)."""
        if self.kv_events is None:
            return None
        b = self.pick_any(self.cached_role)
        if b is None:
            return None
        return await self.kv_events.block_hashes(self.client, b.url, path, body, headers)

    @staticmethod
    def _not_in_pd(path: str) -> Response:
        return error(400, f"router: {path} is not served in prefill/decode mode (the prefill "
                          "hop hands kv_transfer_params over on /v1/completions and "
                          "/v1/chat/completions only); use those, or a router with --replicas",
                     path=path)

    # -- the Responses API: a stored response lives on the replica that made it --------------
    def _remember(self, body: dict):
        if body.get("store") is False:
            return None
        return lambda rid, b: self.homes.put(rid, b.url)

    async def _response(self, body: dict, headers: dict, key: str) -> Response:
        prev = body.get("previous_response_id")
        if prev is None:
            return await self._forward("replica", RESPONSES, body, headers, key, "replicas", 1,
                                       on_id=self._remember(body))
        try:
            check_response_id(prev, "previous_response_id")
        except ValueError as e:
            return error(400, str(e), "previous_response_id")
        home = await self._home(prev, headers)
        if home is None:
            return error(404, f"previous_response_id: no replica holds a stored response "
                              f"{prev!r}", "previous_response_id")
        self.metrics.routed.labels(home.url, "previous_response").inc()
        return await self._forward("replica", RESPONSES, body, headers, key, "replicas", 0,
                                   pinned=home, on_id=self._remember(body))

    async def _home(self, response_id: str, headers: dict) -> Backend | None:
        """The replica that stored `response_id`: remembered, else the one that has it."""
        url = self.homes.get(response_id)
        b = self.workers.find(url) if url is not None else None
        if b is not None:
            return b
        pool = self.pool("replica")

        async def has(b: Backend) -> bool:
            try:
                r = await self.client.get(b.url + stored_path(response_id), headers=headers)
            except httpx.HTTPError:
                return False
            return r.status_code == 200
        found = await asyncio.gather(*(has(b) for b in pool))
        b = next((b for b, ok in zip(pool, found) if ok), None)
        if b is not None:
            self.homes.put(response_id, b.url)
        return b

    async def stored_response(self, method: str, response_id: str, suffix: str,
                              raw: Request) -> Response:
        """GET or DELETE /v1/responses/{id}[/input_items], on the replica that stored it."""
        if self.pd:
            return self._not_in_pd(RESPONSES)
        try:
            check_response_id(response_id, "response_id")
        except ValueError as e:
            return error(400, str(e), "response_id")
        headers = self._headers(raw)
        b = await self._home(response_id, headers)
        if b is None:
            return error(404, f"router: no replica holds a stored response {response_id!r}",
                         "response_id")
        try:
            r = await self.client.request(method, b.url + stored_path(response_id, suffix),
                                          params=list(raw.query_params.multi_items()),
                                          headers=headers)
        except httpx.HTTPError as e:
            self._failed(b, unreachable=isinstance(e, httpx.TransportError))
            return error(502, f"router: replica {b.url} failed: {type(e).__name__}")
        if method == "DELETE" and r.status_code == 200:
            self.homes.forget(response_id)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    async def fan_out(self, path: str, raw: Request) -> Response:
        """LoRA load or unload on every worker (router_endpoints.FanOut)."""
        body = await self._body(path, raw)
        if isinstance(body, Response):
            return body
        return await FanOut(self.client).send([b.url for b in self.backends], path, body,
                                              self._headers(raw))

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

    async def add_worker(self, url: str | None, role: str | None,
                         kv_events_endpoint: str | None = None) -> Response:
        if role is None:
            if self.pd:
                return error(400, "role: give role=prefill or role=decode", "role")
            role = "replica"
        if kv_events_endpoint is not None:
            if self.kv_events is None or role != self.cached_role:
                return error(400, "kv_events_endpoint: only for a router started with "
                                  f"--kv-events-endpoints, for a {self.cached_role} worker",
                             "kv_events_endpoint")
            try:
                check_endpoint(kv_events_endpoint)
            except ValueError as e:
                return error(400, f"router: {e}", "kv_events_endpoint")
        try:
            b = self.workers.add(url, role)
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            return error(400, f"router: {e}", param if param in ("url", "role") else None)
        if kv_events_endpoint is not None:
            b.kv_events_endpoint = kv_events_endpoint
            self.kv_events.listen(b, kv_events_endpoint)
        # it takes requests as soon as it answers; until then the health checks watch it
        b.oks = self.workers.health.success_threshold - 1
        await self.workers.probe(b)
        return JSONResponse({"added": b.url, "role": b.role, "healthy": b.healthy})

    def listing(self) -> dict:
        """The workers, the policy and, for a worker whose KV events are followed, how many
        blocks its prefix cache holds as they say, the batches applied, the gaps in their
        numbering (batches lost) and the messages skipped as malformed."""
        out = dict(self.workers.listing(), policy=self.policy_name)
        if self.kv_events is not None:
            for w, b in zip(out["workers"], self.workers.all):
                listener = self.kv_events.listeners.get(b)
                if listener is not None:
                    w.update(kv_cache_blocks=self.kv_events.index.size(b),
                             kv_event_batches=listener.batches, kv_event_gaps=listener.gaps,
                             kv_event_bad_messages=listener.bad)
        return out

    async def remove_worker(self, url: str | None) -> Response:
        b = self.workers.remove(url) if url else None
        if b is None:
            return error(404, f"router: {str(url)[:200]!r} is not a worker", "url")
        if self.kv_events is not None:
            self.kv_events.drop(b)
        return JSONResponse({"removed": b.url, "role": b.role, "inflight": b.inflight})

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = self.workers.client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        if self.workers.health.interval_s > 0:
            self._checks = asyncio.create_task(self.workers.run_checks(), name="router-health")
        if self.kv_events is not None:
            for b in self.pool(self.cached_role):
                if b.kv_events_endpoint is not None:
                    self.kv_events.listen(b, b.kv_events_endpoint)

    async def stop(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self._checks is not None:
            self._checks.cancel()
            await asyncio.gather(self._checks, return_exceptions=True)
        await self.client.aclose()


class _Retry(Exception):
    """A 5xx from a worker, before anything reached the client."""


def _json_id(data: bytes) -> str | None:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    rid = body.get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) else None


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvflow router")

    @app.on_event("startup")
    async def _start() -> None:
        await router.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        await router.stop()

    def forwarded(path: str):
        async def endpoint(raw: Request):
            return await router.handle(path, raw)
        return endpoint

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", RESPONSES,
                 ANTHROPIC_PREFIX, *ANY_WORKER):
        app.add_api_route(path, forwarded(path), methods=["POST"])

    def fanned_out(path: str):
        async def endpoint(raw: Request):
            return await router.fan_out(path, raw)
        return endpoint

    for path in FAN_OUT:
        app.add_api_route(path, fanned_out(path), methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request):
        return await router.stored_response("GET", response_id, "", raw)

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(response_id: str, raw: Request):
        return await router.stored_response("GET", response_id, "/input_items", raw)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        return await router.stored_response("DELETE", response_id, "", raw)

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
    async def add_worker(raw: Request, url: str | None = None, role: str | None = None,
                         kv_events_endpoint: str | None = None):
        return router.admin_refusal(raw) or await router.add_worker(url, role,
                                                                    kv_events_endpoint)

    @app.post("/remove_worker")
    async def remove_worker(raw: Request, url: str | None = None):
        return router.admin_refusal(raw) or await router.remove_worker(url)

    @app.get("/list_workers")
    async def list_workers(raw: Request):
        return router.admin_refusal(raw) or JSONResponse(router.listing())

    return app


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        cache = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold,
                                 args.balance_rel_threshold, args.max_tree_size)
        health = HealthConfig(args.health_check_interval_secs, args.health_check_timeout_secs,
                              args.health_failure_threshold, args.health_success_threshold)
        router = Router(args.prefill or [], args.decode or [], args.replicas or [], args.timeout,
                        args.policy, cache, health, args.admin_api_key,
                        args.kv_events_endpoints, args.kv_events_topic)
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
    g.add_argument("--kv-events-endpoints", nargs="+", metavar="ADDR",
                   help="each replica's (PD: each prefill instance's) KV events publisher, "
                        "tcp://HOST:PORT or ipc://PATH, in the order of --replicas (--prefill): "
                        "cache_aware and least_load then score by the blocks each one really "
                        "holds (replicas started with --kv-events-config)")
    g.add_argument("--kv-events-topic", default="",
                   help="the topic the replicas publish under (kv_events_config's `topic`)")
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
