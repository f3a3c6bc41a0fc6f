"""`kvflow router` in front of two real `kvflow serve` replicas of the default model.

One router and two replicas for the module; the tests run in order: the second replica joins at
run time, requests sharing a prefix land on one replica (whose prefix cache then hits), a load
imbalance overrides the prefix, a removed replica gets nothing more, a stopped replica is
dropped by the health checks and taken back when it answers again, and a replica killed before
a request's first token makes the router retry that request once on the other (last: it kills
one). Time limits are hang guards."""
from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_helpers import REPO, ServerProcess, free_port, metric_value
from kvflow.utils.process import die_with_parent

pytestmark = pytest.mark.slow

REPLICA_ARGS = ["--max-model-len", "512", "--num-blocks", "96", "--max-num-seqs", "8"]
GUARD_S = 60
SYSTEM = ("You are a patient tutor. Explain every idea in plain words, give one short example, "
          "and never use jargon without saying what it means. ")


def wait_until(cond, what: str, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not after {timeout}s"
        time.sleep(0.05)


class RouterProcess:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.entrypoints.cli", "router", "--port", str(self.port),
             *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
        wait_until(lambda: self.proc.poll() is not None or self._up(), "router up")
        assert self.proc.poll() is None, "the router exited"

    def _up(self) -> bool:
        try:
            return httpx.get(self.url + "/list_workers", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in httpx.get(self.url + "/list_workers").json()["workers"]}

    def routed(self) -> dict[str, float]:
        """Requests the router sent to each backend so far (all reasons)."""
        counts: dict[str, float] = {}
        for url, value in re.findall(r'^kvflow_router:backend_requests_total\{backend="([^"]+)"'
                                     r'[^}]*\} (\S+)$', httpx.get(self.url + "/metrics").text,
                                     re.M):
            counts[url] = counts.get(url, 0.0) + float(value)
        return counts

    def metric(self, name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(self.url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster():
    # one after the other: a child started from a pool thread would get its parent-death
    # signal when that thread ends
    a = ServerProcess(*REPLICA_ARGS)
    b = ServerProcess(*REPLICA_ARGS)
    router = None
    try:
        router = RouterProcess("--replicas", a.url, "--balance-abs-threshold", "2",
                               "--health-check-interval-secs", "0.3",
                               "--health-check-timeout-secs", "3",
                               "--health-failure-threshold", "2",
                               "--health-success-threshold", "1")
        yield router, a, b
    finally:
        if router is not None:
            router.close()
        a.close()
        b.close()


def chat(url: str, question: str, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=GUARD_S)


def delta(before: dict, after: dict) -> dict:
    return {u: after.get(u, 0) - before.get(u, 0) for u in after if after.get(u, 0) - before.get(u, 0)}


def test_a_replica_joins_at_run_time(cluster):
    router, a, b = cluster
    assert list(router.workers()) == [a.url]
    resp = httpx.post(router.url + "/add_worker", params={"url": b.url})
    assert resp.status_code == 200 and resp.json()["added"] == b.url, resp.text
    # routed to once it answers a probe (at once, unless the machine is slow to answer)
    wait_until(lambda: router.workers()[b.url]["healthy"], "added replica healthy")
    again = httpx.post(router.url + "/add_worker", params={"url": b.url})
    assert again.status_code == 400 and again.json()["error"]["param"] == "url"
    bad = httpx.post(router.url + "/add_worker", params={"url": "ftp://x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert httpx.post(router.url + "/remove_worker", params={"url": "http://nowhere:1"}).status_code == 404


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(cluster):
    router, a, b = cluster
    before = router.routed()
    hits = {s.url: metric_value(s.url, "kvflow:prefix_cache_hits_total") for s in (a, b)}
    for q in ("What is a list?", "What is a loop?", "What is a graph?", "What is a tree?"):
        assert chat(router.url, q).status_code == 200
    sent = delta(before, router.routed())
    assert len(sent) == 1 and sum(sent.values()) == 4, sent
    home = next(iter(sent))
    assert metric_value(home, "kvflow:prefix_cache_hits_total") > hits[home]
    # prompts that share nothing go where the tree is smaller: the other replica
    other = b.url if home == a.url else a.url
    before = router.routed()
    for i in range(3):
        assert httpx.post(router.url + "/v1/completions", timeout=GUARD_S, json={
            "prompt": f"{i} unrelated prompt", "max_tokens": 2}).status_code == 200
    assert delta(before, router.routed()) == {other: 3}


def test_a_load_imbalance_overrides_the_prefix(cluster):
    router, a, b = cluster
    before = router.routed()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(chat, router.url, f"Question {i}: what is recursion?", 24)
                for i in range(8)]
        assert all(f.result(GUARD_S).status_code == 200 for f in futs)
    sent = delta(before, router.routed())
    assert set(sent) == {a.url, b.url}, sent  # the home replica alone would have taken all 8


def test_a_removed_replica_gets_no_more_requests(cluster):
    router, a, b = cluster
    resp = httpx.post(router.url + "/remove_worker", params={"url": b.url})
    assert resp.status_code == 200, resp.text
    try:
        before = router.routed()
        for i in range(3):
            assert httpx.post(router.url + "/v1/completions", timeout=GUARD_S, json={
                "prompt": f"another unrelated prompt {i}", "max_tokens": 2}).status_code == 200
        assert delta(before, router.routed()) == {a.url: 3}
    finally:
        assert httpx.post(router.url + "/add_worker", params={"url": b.url}).status_code == 200
        wait_until(lambda: router.workers()[b.url]["healthy"], "replica back")


def test_a_stopped_replica_is_dropped_and_taken_back(cluster):
    router, a, b = cluster
    os.killpg(b.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not router.workers()[b.url]["healthy"], "stopped replica dropped")
        before = router.routed()
        assert httpx.post(router.url + "/v1/completions", timeout=GUARD_S, json={
            "prompt": "while one replica is stopped", "max_tokens": 2}).status_code == 200
        assert delta(before, router.routed()) == {a.url: 1}
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)
    wait_until(lambda: router.workers()[b.url]["healthy"], "replica taken back")


def test_a_replica_killed_before_the_first_token_is_retried_on_the_other(cluster):
    """Last: it kills a replica. The replica the shared prefix lives on is stopped, a streamed
    request with that prefix is sent (the router, by the cache, picks the stopped one: its TCP
    backlog takes the connection), then the replica is killed: the request is retried once on
    the other replica, which streams the whole answer."""
    router, a, b = cluster
    # where does the prefix live now? (ask once more: the cache decides)
    before = router.routed()
    assert chat(router.url, "What is a set?").status_code == 200
    home_url = next(iter(delta(before, router.routed())))
    victim, survivor = (a, b) if home_url == a.url else (b, a)
    retries = router.metric("kvflow_router:retries_total")
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(chat, router.url, "What is a map?", 6, True)
        inflight = rf'^kvflow_router:inflight\{{backend="{re.escape(victim.url)}"\}} 1\.0$'
        wait_until(lambda: re.search(inflight, httpx.get(router.url + "/metrics").text, re.M),
                   "request sent to the stopped replica", timeout=10)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        resp = fut.result(GUARD_S)
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), resp.text[-500:]
    assert router.metric("kvflow_router:retries_total") == retries + 1
    wait_until(lambda: not router.workers()[victim.url]["healthy"], "dead replica dropped")
    before = router.routed()
    assert chat(router.url, "What is a queue?").status_code == 200
    assert delta(before, router.routed()) == {survivor.url: 1}
