"""`kvflow serve --data-parallel-size 2`: two engine cores behind one server. Requests spread over
both, a shared prefix goes back to the replica that holds it, /metrics has a series per replica,
and one replica's death is the server's (/health 503). The refusals are fast tests."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from server_helpers import ServerProcess
from kvflow.options import engine_config

GUARD_S = 60
PREFIX = ("Here is a long shared instruction that every request of this test repeats word for "
          "word, so that it fills several KV blocks of sixteen tokens each and can be found in a "
          "replica's prefix cache when the next request arrives. ")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--data-parallel-size", "2", "--max-model-len", "512", "--num-blocks", "64")
    try:
        yield srv
    finally:
        srv.close()


def per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {e: float(v) for e, v in
            re.findall(rf'^{re.escape(name)}\{{engine="(\d+)"[^}}]*\}} (\S+)$', text, re.M)}


def complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=GUARD_S,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


@pytest.mark.slow
def test_requests_spread_over_both_replicas_and_metrics_show_both(server):
    assert "data parallel: 2 engine cores" in server.output()
    before = per_engine(server.url, "kvflow:engine_requests_finished_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(complete, server.url, f"Count from {i} to {i + 5}:", 16) for i in range(6)]
        assert all(f.result(GUARD_S).status_code == 200 for f in futs)
    after = per_engine(server.url, "kvflow:engine_requests_finished_total")
    assert set(after) == {"0", "1"}
    assert all(after[e] > before.get(e, 0) for e in after), (before, after)
    assert sum(after.values()) - sum(before.values()) == 6
    assert set(per_engine(server.url, "kvflow:num_total_blocks").values()) == {64.0}
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_a_shared_prefix_goes_back_to_the_replica_that_holds_it(server):
    before = per_engine(server.url, "kvflow:prefix_cache_hits_total")
    finished = per_engine(server.url, "kvflow:engine_requests_finished_total")
    for q in ("First question?", "Second question?", "Third question?"):
        assert complete(server.url, PREFIX + q).status_code == 200  # one at a time: loads tie
    done = per_engine(server.url, "kvflow:engine_requests_finished_total")
    went = [e for e in done if done[e] > finished.get(e, 0)]
    assert len(went) == 1 and done[went[0]] - finished[went[0]] == 3, (finished, done)
    hits = per_engine(server.url, "kvflow:prefix_cache_hits_total")
    assert hits[went[0]] - before.get(went[0], 0) >= 2 * 32  # two requests x two full blocks


@pytest.mark.slow
def test_a_dead_replica_makes_the_server_unhealthy(server):
    """Last: it kills one engine core."""
    cores = [c for c in server.children if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 2
    os.kill(cores[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + GUARD_S
    while True:
        try:
            health = httpx.get(server.url + "/health", timeout=5)
        except httpx.HTTPError:
            break  # already exited, as a dead engine's server does
        if health.status_code == 503:
            assert "data-parallel replica" in health.json()["error"]["message"]
            break
        assert time.monotonic() < deadline, "still healthy with a dead replica"
        time.sleep(0.1)
    assert server.proc.wait(GUARD_S) == 1  # it exits, like a server whose engine died


def test_data_parallel_size_is_checked_and_refused_where_it_cannot_work():
    assert engine_config(data_parallel_size=2).parallel_config.data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be in 1..64"):
        engine_config(data_parallel_size=0)
    with pytest.raises(ValueError, match="trace"):
        engine_config(data_parallel_size=2, trace="x.jsonl")
    with pytest.raises(ValueError, match="kv_transfer_config"):
        engine_config(data_parallel_size=2, kv_transfer_config='{"kv_role": "kv_producer"}')
    from kvflow.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="kvflow serve"):
        LLMEngine(engine_config(data_parallel_size=2))


@pytest.mark.slow
def test_replicas_as_ray_actors_serve_and_a_dead_one_is_the_servers():
    """--data-parallel-backend ray: each engine core is a Ray actor (Ray starts a local cluster
    on the loopback interface here), reached over TCP; requests spread over both, and killing
    one actor's process makes the server unhealthy and exit."""
    pytest.importorskip("ray")
    import psutil

    srv = ServerProcess("--data-parallel-size", "2", "--data-parallel-backend", "ray",
                        "--max-model-len", "512", "--num-blocks", "64")
    try:
        pids = [int(p) for p in re.search(r"engine cores \(pids ([\d, ]+)\)", srv.output()).group(1).split(", ")]
        actors = [psutil.Process(p) for p in pids]
        assert all("EngineCoreActor" in " ".join(a.cmdline()) for a in actors), \
            [a.cmdline() for a in actors]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(complete, srv.url, f"Count from {i} to {i + 5}:", 8) for i in range(6)]
            assert all(f.result(GUARD_S).status_code == 200 for f in futs)
        done = per_engine(srv.url, "kvflow:engine_requests_finished_total")
        assert set(done) == {"0", "1"} and all(v > 0 for v in done.values()), done
        actors[1].kill()
        assert srv.proc.wait(GUARD_S) == 1  # one replica's death is the server's
    finally:
        srv.close()
