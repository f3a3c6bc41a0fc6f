"""The router's workers: who they are, whether they answer, and joining or leaving at run time.

A worker is one `kvflow serve` URL in a pool (replicas, or prefill and decode). A background
task probes every worker's `/health` each `health_check_interval_secs`; `health_failure_threshold`
failures in a row take it out of routing (and forget what the cache-aware tree thought it held:
a restarted server's cache is empty), `health_success_threshold` answers in a row take it back.
A call that cannot reach a worker takes it out at once. `POST /add_worker?url=` and
`POST /remove_worker?url=` (SGLang router's endpoints) change the pools while requests run."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from kvflow.core.routing import RoutingPolicy

MAX_URL_CHARS = 2048


@dataclass(eq=False)
class Backend:
    url: str
    role: str  # prefill | decode | replica
    inflight: int = 0
    healthy: bool = True
    fails: int = 0  # failed probes (or calls) in a row
    oks: int = 0  # answered probes in a row
    kv_events_endpoint: str | None = None  # its KV events publisher, where the router follows it


@dataclass
class HealthConfig:
    interval_s: float = 10.0  # 0: no background checks
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.timeout_s <= 0:
            raise ValueError("health check interval must be >= 0 and its timeout > 0")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health failure and success thresholds must be >= 1")


def check_worker_url(url: object) -> str:
    """The URL without a trailing slash, or ValueError saying what is wrong with it."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise ValueError(f"url: give an http(s) URL of at most {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url: {url[:200]!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("url: no query, fragment or credentials in a worker URL")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as e:
        raise ValueError(f"url: {e}") from None
    return url.rstrip("/")


class Workers:
    """The pools by role, each with its routing policy, and their health."""

    def __init__(self, pools: dict[str, list[str]], policies: dict[str, RoutingPolicy],
                 health: HealthConfig) -> None:
        self.pools: dict[str, list[Backend]] = {
            role: [Backend(check_worker_url(u), role) for u in urls]
            for role, urls in pools.items()}
        self.policies = policies
        self.health = health
        self.client: httpx.AsyncClient | None = None
        self.on_change = lambda b: None  # metrics hook: a worker's health or presence changed

    @property
    def all(self) -> list[Backend]:
        return [b for pool in self.pools.values() for b in pool]

    def find(self, url: str) -> Backend | None:
        return next((b for b in self.all if b.url == url), None)

    def add(self, url: str, role: str) -> Backend:
        if role not in self.pools:
            raise ValueError(f"role: must be one of {', '.join(self.pools)} here, got {role!r}")
        url = check_worker_url(url)
        if self.find(url) is not None:
            raise ValueError(f"url: {url} is already a worker")
        b = Backend(url, role, healthy=False)  # routed to once it answers /health
        self.pools[role].append(b)
        self.on_change(b)
        return b

    def remove(self, url: str) -> Backend | None:
        b = self.find(url.rstrip("/")) if isinstance(url, str) else None
        if b is None:
            return None
        self.pools[b.role].remove(b)  # requests in flight on it finish there
        self.policies[b.role].forget(b)
        self.on_change(b)
        return b

    def mark(self, b: Backend, ok: bool) -> None:
        """One probe's (or call's) outcome, counted against the thresholds."""
        if ok:
            b.oks, b.fails = b.oks + 1, 0
            if not b.healthy and b.oks >= self.health.success_threshold:
                b.healthy = True
                self.on_change(b)
        else:
            b.fails, b.oks = b.fails + 1, 0
            if b.healthy and b.fails >= self.health.failure_threshold:
                self.take_out(b)

    def take_out(self, b: Backend) -> None:
        """Out of routing now (unreachable): its cached prefixes are forgotten."""
        b.oks = 0
        if b.healthy:
            b.healthy = False
            self.policies[b.role].forget(b)
            self.on_change(b)

    async def probe(self, b: Backend) -> bool:
        try:
            r = await self.client.get(b.url + "/health", timeout=self.health.timeout_s)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.mark(b, ok)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(b) for b in self.all))

    async def run_checks(self) -> None:
        """The background task: probe everyone every interval."""
        while True:
            await asyncio.sleep(self.health.interval_s)
            await self.probe_all()

    def listing(self) -> dict:
        return {"workers": [{"url": b.url, "role": b.role, "healthy": b.healthy,
                             "inflight": b.inflight,
                             **({"kv_events_endpoint": b.kv_events_endpoint}
                                if b.kv_events_endpoint else {})} for b in self.all]}
