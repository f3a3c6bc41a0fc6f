"""Cache-aware routing by the replicas' KV events: the policy scores a request by the blocks
each replica really holds, and `kvflow router --kv-events-endpoints` follows two (fake)
replicas' events, so that a prompt goes where its prefix is cached, and after that replica
evicts it (BlockRemoved) the same prompt no longer does.

The fake replicas answer /tokenize (one id per character) and /v1/completions (with their name)
over HTTP, and publish KV events as an engine does (kvflow/engine/kv_events.py's publisher)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from server_helpers import free_port
from test_router_replicas import RouterProcess
from kvflow.config import KVEventsConfig
from kvflow.core.block_index import BlockIndex
from kvflow.core.kv_cache.block_pool import hash_token_blocks
from kvflow.core.routing import CacheAwareConfig, make_policy
from kvflow.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                     ZmqEventPublisher)

BS = 4
PROMPT = "Explain paged attention in one line."  # 36 characters: 9 blocks of 4 ids


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


# -- the policy, no network ------------------------------------------------------------------
def test_the_replica_holding_the_longest_leading_run_wins_and_an_eviction_moves_it():
    index = BlockIndex()
    policy = make_policy("cache_aware", CacheAwareConfig(), blocks=index)
    hashes = hash_token_blocks(ids(PROMPT), BS)
    index.stored("a", hashes[:3], BS)  # a shorter run
    index.stored("b", hashes, BS)
    index.stored("c", hashes[1:], BS)  # all but the first: no leading run at all
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, hashes)
    assert (choice.replica, choice.reason, choice.matched) == ("b", "kv_cache_hit", len(hashes))
    policy.routed("b", PROMPT)  # the text tree now says b too: the events decide regardless
    index.removed("b", hashes[4:5])  # b keeps 4 leading blocks of 9, a 3: any real run counts
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, hashes)
    assert (choice.replica, choice.reason, choice.matched) == ("b", "kv_cache_hit", 4)
    index.removed("b", hashes[:1])  # b lost the first block: its other blocks serve nothing
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, hashes)
    assert (choice.replica, choice.matched) == ("a", 3)
    index.cleared("a")  # nobody holds the first block: the emptiest takes it
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, hashes)
    assert (choice.replica, choice.reason) == ("a", "fewest_blocks")  # a 0, b 7, c 8
    index.stored("c", hashes[:1], BS)  # c computed the first block: its whole run is there
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, hashes)
    assert (choice.replica, choice.matched) == ("c", len(hashes))
    # without hashes (a prompt under one block, no tokenizer answer) the text tree routes
    choice = policy.choose({"a": 0, "b": 0, "c": 0}, PROMPT, None)
    assert (choice.replica, choice.reason) == ("b", "cache_hit")


def test_a_running_requests_prompt_counts_as_held_until_it_ends():
    index = BlockIndex()
    policy = make_policy("cache_aware", CacheAwareConfig(), blocks=index)
    hashes = hash_token_blocks(ids(PROMPT), BS)
    index.stored("a", hash_token_blocks(ids("Another prompt, another story"), BS), BS)
    index.running("b", hashes, 1)  # sent to b, its BlockStored not back yet
    index.running("b", hashes, 1)
    choice = policy.choose({"a": 0, "b": 2}, PROMPT, hashes)
    assert (choice.replica, choice.reason) == ("b", "kv_cache_hit")  # a burst follows it
    index.running("b", hashes, -1)
    index.running("b", hashes, -1)  # both ended, and no event said b kept the blocks
    assert policy.choose({"a": 0, "b": 0}, PROMPT, hashes).reason == "fewest_blocks"


def test_least_load_breaks_ties_by_the_blocks_held_and_load_still_comes_first():
    index = BlockIndex()
    policy = make_policy("least_load", blocks=index)
    hashes = hash_token_blocks(ids(PROMPT), BS)
    index.stored(1, hashes, BS)
    assert policy.choose({0: 0, 1: 0}, PROMPT, hashes).replica == 1
    assert policy.choose({0: 0, 1: 1}, PROMPT, hashes).replica == 0


def test_the_index_keeps_one_block_size_and_attention_group_0_and_is_bounded():
    index = BlockIndex(max_blocks=4)
    hashes = hash_token_blocks(ids(PROMPT), BS)
    index.stored("a", hashes, BS)
    assert index.size("a") == 4 and index.block_size == BS
    index.stored("b", hashes, 8)  # another block size: its hashes could never match
    index.stored("b", hashes, BS, group_idx=1)  # a sliding-window group's copy
    index.stored("b", [b"short", 7], BS)  # not a kvflow hash
    assert index.size("b") == 0


# -- the router, two fake replicas -----------------------------------------------------------
class FakeReplica:
    """/tokenize, /v1/completions and /health over HTTP, and a KV events publisher."""

    def __init__(self, name: str) -> None:
        self.name = name
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/tokenize")
        async def tokenize(body: dict):
            return {"tokens": ids(body["prompt"]), "count": len(body["prompt"])}

        @app.post("/v1/completions")
        async def completions(body: dict):
            return {"id": "cmpl-1", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": name, "finish_reason": "length"}]}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        events_port = free_port()
        self.events = f"tcp://127.0.0.1:{events_port}"
        self.publisher = ZmqEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"tcp://*:{events_port}"))
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake replica did not start"
            time.sleep(0.02)

    def publish(self, *events) -> None:
        self.publisher.publish(KVEventBatch(time.time(), list(events)))

    def close(self) -> None:
        self.publisher.shutdown()
        self.server.should_exit = True
        self.thread.join(5)


def stored(text: str) -> BlockStored:
    return BlockStored(hash_token_blocks(ids(text), BS), None, ids(text)[:len(text) // BS * BS],
                       BS, None, "CPU", None)


@pytest.fixture
def cluster():
    a, b = FakeReplica("A"), FakeReplica("B")
    router = None
    try:
        router = RouterProcess("--replicas", a.url, b.url, "--kv-events-endpoints", a.events,
                               b.events, "--health-check-interval-secs", "0")
        yield router, a, b
    finally:
        if router is not None:
            router.close()
        a.close()
        b.close()


def publish_until(router: RouterProcess, replica: FakeReplica, blocks: int, *events) -> None:
    """Publish until the router says `replica` holds `blocks` blocks (a SUB socket joins a
    moment after it connects and misses what came before)."""
    deadline = time.monotonic() + 30
    while router.workers()[replica.url].get("kv_cache_blocks") != blocks:
        assert time.monotonic() < deadline, f"the router never saw {replica.name} hold {blocks}"
        replica.publish(*events)
        time.sleep(0.1)


def complete(router: RouterProcess, prompt: str) -> str:
    r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def reasons(router: RouterProcess) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvflow_router:backend_requests_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow  # starts a router
def test_the_router_follows_the_replicas_events_and_an_eviction_changes_the_route(cluster):
    router, a, b = cluster
    hashes = stored(PROMPT).block_hashes
    other = stored("Something else entirely, twelve")  # 7 blocks A holds: A is fuller
    publish_until(router, a, 7, other)
    publish_until(router, b, len(hashes), stored(PROMPT))
    # with the text tree alone the first request would go to A (both trees empty, A first)
    assert complete(router, PROMPT) == "B"
    assert reasons(router) == {"kv_cache_hit": 1}

    publish_until(router, b, 0, BlockRemoved(hashes, "CPU"))  # B evicted the prompt
    assert complete(router, PROMPT) == "B"  # nobody holds it: the emptier replica, B
    assert reasons(router) == {"kv_cache_hit": 1, "fewest_blocks": 1}

    publish_until(router, a, 7 + len(hashes), stored(PROMPT))  # now A computed it
    assert complete(router, PROMPT) == "A"  # though the text tree remembers B
    assert reasons(router) == {"kv_cache_hit": 2, "fewest_blocks": 1}

    publish_until(router, a, 0, AllBlocksCleared())
    assert complete(router, PROMPT) == "A"  # both empty now: the first of equals
    assert reasons(router)["fewest_blocks"] == 2


@pytest.mark.slow  # starts a router
def test_a_worker_added_at_run_time_brings_its_events_endpoint(cluster):
    router, a, b = cluster
    r = httpx.post(router.url + "/add_worker", params={
        "url": "http://127.0.0.1:9", "kv_events_endpoint": "tcp://*:5557"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_events_endpoint"
    c = FakeReplica("C")
    try:
        r = httpx.post(router.url + "/add_worker", params={"url": c.url,
                                                           "kv_events_endpoint": c.events})
        assert r.status_code == 200, r.text
        publish_until(router, c, 9, stored(PROMPT))
        assert complete(router, PROMPT) == "C"
        httpx.post(router.url + "/remove_worker", params={"url": c.url})
        assert c.url not in router.workers()
    finally:
        c.close()


def test_endpoints_must_match_the_replicas():
    from kvflow.entrypoints.router import Router

    with pytest.raises(ValueError, match="kv_events_endpoints: give one per --replicas"):
        Router([], [], ["http://127.0.0.1:1", "http://127.0.0.1:2"],
               kv_events_endpoints=["tcp://127.0.0.1:5557"])
    with pytest.raises(ValueError, match="kv_events_endpoints: .*tcp://HOST:PORT"):
        Router([], [], ["http://127.0.0.1:1"], kv_events_endpoints=["tcp://*:5557"])
