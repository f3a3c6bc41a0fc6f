"""`kvflow serve` under load, faults and bad input, and prefix caching seen through the API.

A real server subprocess with the default model and a small KV pool (so that the soak runs
under block pressure). `KVFLOW_SOAK=long` runs the long soak (500 requests, 32 concurrent)
and a longer fuzz instead of the small versions.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time

import httpx
import psutil
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

LONG = os.environ.get("KVFLOW_SOAK") == "long"
BLOCK_SIZE = 16
NUM_BLOCKS = 96
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 512
# ~12 blocks of shared text: longer than 10 full blocks once tokenized.
SYSTEM = ("You are a careful assistant for a small bakery. Answer briefly and politely. "
          "The bakery opens at seven, closes at six, bakes sourdough, rye and brioche, and "
          "sells coffee, tea and hot chocolate. Orders over twenty loaves need a day's notice. "
          "There is no gluten-free bread, but there are almond macarons and fruit tarts. "
          "Parking is behind the shop; dogs are welcome on the terrace. ") * 2
WORDS = ("apple river stone cloud quiet orange window silver garden little morning bread "
         "yellow north letter music candle forest").split()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", str(NUM_BLOCKS),
                        "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--scheduling-policy", "priority", "--enable-prompt-tokens-details")
    yield srv
    srv.close()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def wait_for_idle(url: str, timeout: float = 15.0) -> None:
    """Until every block is free again (the core reports it after its next step)."""
    deadline = time.monotonic() + timeout
    while metric(url, "kvflow:num_free_blocks") != metric(url, "kvflow:num_total_blocks"):
        assert time.monotonic() < deadline, "KV blocks not back to idle"
        time.sleep(0.1)


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached_tokens(result: dict) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


# -- prefix caching through the server -------------------------------------------------------

def test_second_request_sharing_a_long_prefix_is_served_from_the_cache(server):
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    hits_before = metric(server.url, "kvflow:prefix_cache_hits_total")
    queries_before = metric(server.url, "kvflow:prefix_cache_queries_total")
    first = complete(server.url, SYSTEM + "Question: when do you open?")
    second = complete(server.url, SYSTEM + "Question: do you sell rye bread?")
    assert cached_tokens(first) == 0
    n_prompt = second["usage"]["prompt_tokens"]
    shared = cached_tokens(second)
    # At least 10 full blocks of the shared text come from the cache, and only whole blocks.
    assert shared >= 10 * BLOCK_SIZE and shared % BLOCK_SIZE == 0 and shared < n_prompt
    assert metric(server.url, "kvflow:prefix_cache_hits_total") - hits_before == shared
    assert (metric(server.url, "kvflow:prefix_cache_queries_total") - queries_before
            >= first["usage"]["prompt_tokens"] + n_prompt - 2)


def test_chat_usage_reports_cached_tokens_too(server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * BLOCK_SIZE


def test_cache_salt_keeps_users_from_sharing_blocks(server):
    prompt = SYSTEM + "Question: is there parking?"
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    alice = complete(server.url, prompt, cache_salt="alice")
    bob = complete(server.url, prompt, cache_salt="bob")
    unsalted = complete(server.url, prompt)
    alice_again = complete(server.url, prompt, cache_salt="alice")
    assert cached_tokens(alice) == cached_tokens(bob) == cached_tokens(unsalted) == 0
    assert cached_tokens(alice_again) >= 10 * BLOCK_SIZE
    # Same greedy text whoever asks and whether or not it came from the cache.
    assert alice["choices"][0]["text"] == bob["choices"][0]["text"] == alice_again["choices"][0]["text"]


def test_reset_prefix_cache_is_refused_while_requests_run(server):
    prompt = SYSTEM + "Tell me a long story."
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            err = assert_openai_error(http.post("/reset_prefix_cache"), 409)
            assert "running" in err["message"]
    wait_for_idle(server.url)
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    assert cached_tokens(complete(server.url, prompt)) == 0  # really cleared


def test_priority_field_is_accepted_and_checked(server):
    assert complete(server.url, "Hi", priority=-5)["choices"][0]["finish_reason"]
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "priority": "high"})
    assert assert_openai_error(resp, 400)["param"] == "priority"


# -- hostile input ---------------------------------------------------------------------------

HOSTILE = [
    ("n_10000", {"prompt": "Hi", "n": 10_000}, "n must be at most"),
    ("max_tokens_1e9", {"prompt": "Hi", "max_tokens": 10**9}, "max_model_len"),
    ("logprobs_10000", {"prompt": "Hi", "logprobs": 10_000}, "logprobs"),
    ("negative_max_tokens", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("negative_n", {"prompt": "Hi", "n": -3}, "n"),
    ("negative_temperature", {"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("top_p_over_one", {"prompt": "Hi", "top_p": 7}, "top_p"),
    ("prompt_is_a_number", {"prompt": 12}, "prompt"),
    ("prompt_is_an_object", {"prompt": {"a": 1}}, "prompt"),
    ("max_tokens_is_a_string", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ("stop_is_a_number", {"prompt": "Hi", "stop": 5}, "stop"),
    ("token_id_out_of_vocab", {"prompt": [1, 2, 10**12]}, "vocabulary"),
    ("huge_seed", {"prompt": "Hi", "seed": 2**80}, "seed"),
]


@pytest.mark.parametrize("name,body,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_completion_bodies_get_a_clear_400(server, name, body, needle):
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    err = assert_openai_error(resp, 400)
    assert needle in err["message"]


@pytest.mark.parametrize("raw", [b'{"prompt": "Hi", "temperature": NaN}',
                                 b'{"prompt": "Hi", "temperature": Infinity}',
                                 b'{"prompt": "Hi", "top_p": -Infinity}'])
def test_nan_and_infinity_are_refused(server, raw):
    resp = httpx.post(f"{server.url}/v1/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    assert "finite" in assert_openai_error(resp, 400)["message"]


def test_non_utf8_body_is_a_400(server):
    raw = b'{"prompt": "\xff\xfe\xc3\x28 bad bytes", "max_tokens": 2}'
    resp = httpx.post(f"{server.url}/v1/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    assert "not valid UTF-8" in assert_openai_error(resp, 400)["message"]


def test_ten_megabyte_body_is_a_413_and_the_server_stays_up(server):
    raw = b'{"prompt": "' + b"a" * (10 * 2**20) + b'"}'
    resp = httpx.post(f"{server.url}/v1/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    assert "limit" in assert_openai_error(resp, 413)["message"]

    def chunked():  # no content-length: the server must count as it reads
        for _ in range(10):
            yield b"a" * 2**20

    resp = httpx.post(f"{server.url}/v1/completions", content=chunked(),
                      headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(resp, 413)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_deeply_nested_json_is_a_400(server):
    depth = 100_000
    raw = b'{"prompt": "Hi", "stop": ' + b"[" * depth + b"]" * depth + b"}"
    resp = httpx.post(f"{server.url}/v1/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=60)
    assert "nested too deeply" in assert_openai_error(resp, 400)["message"]
    messages = {"messages": [{"role": "user", "content": [[[[[["deep"]]]]]]}]}
    assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=messages), 400)
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- fuzz against the OpenAPI schema ---------------------------------------------------------

def _bounded(body):
    """Keep fuzzed generation short: the fuzz is about the input, not about decoding."""
    if isinstance(body, dict):
        body["stream"] = False
        for key in ("max_tokens", "max_completion_tokens"):
            # Absent or null means "up to max_model_len": cap it too.
            if body.get(key) is None or (isinstance(body[key], int) and body[key] > 2):
                body[key] = 2
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
    return body


def test_fuzzed_requests_from_the_openapi_schema_never_get_a_5xx(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    examples = 200 if LONG else 50
    failures: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=schema[path]["POST"].as_strategy())
            def check(case):
                body = _bounded(case.body)
                resp = http.post(path, json=body)
                if resp.status_code >= 500:
                    failures.append(f"{path} {resp.status_code} {body!r}: {resp.text[:300]}")
                elif resp.status_code >= 400:
                    err = resp.json().get("error")
                    if not (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)):
                        failures.append(f"{path} {resp.status_code} not OpenAI-shaped: {resp.text[:300]}")

            check()
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_for_idle(server.url)


# -- soak --------------------------------------------------------------------------------------

def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def _soak_client(http: httpx.AsyncClient, rng: random.Random, outcomes: list[str]) -> None:
    words = rng.choices(WORDS, k=rng.randint(1, 120))
    chat = rng.random() < 0.3
    body = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.8]),
            "stream": rng.random() < 0.7, "seed": rng.randint(0, 1000)}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS + [" the", ".", "\n"], k=rng.randint(1, 3))
    if rng.random() < 0.5:
        body["cache_salt"] = rng.choice(["u1", "u2"])
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": " ".join(words)}]
    else:
        path, body["prompt"] = "/v1/completions", SYSTEM[: rng.randint(0, 300)] + " ".join(words)
    cancel_after = rng.randint(0, 6) if rng.random() < 0.2 else None
    if cancel_after is not None and not body["stream"]:
        # A non-streamed client that gives up: cut the connection after a random delay.
        try:
            await asyncio.wait_for(http.post(path, json=body), timeout=rng.uniform(0.05, 1.5))
            outcomes.append("finished")
        except asyncio.TimeoutError:
            outcomes.append("aborted")
        return
    async with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        n = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcomes.append("finished")
                return
            if not body["stream"]:
                break
            assert "error" not in json.loads(line[6:]), line
            n += 1
            if cancel_after is not None and n > cancel_after:
                outcomes.append("aborted")  # leaving the block closes the connection
                return
        outcomes.append("finished")


def test_soak_with_cancellations_leaves_no_leak(server):
    """RSS of each process (frontend, engine core) is sampled at 10 evenly spaced points of the
    run; after warm-up (the first sample) it must stay flat. The long soak (first sample after
    50 requests) holds it within 5%. The short one samples first after 6 requests, while the
    allocator is still growing to the largest batch (from a cold server that growth was 2.3% in
    all, benchmarks/README.md), so it holds 10%: room for another machine's allocator, and still
    a failure for a leak of ~0.7 MiB per request in the frontend or ~1.8 MiB in the engine."""
    total = 500 if LONG else 60
    concurrency = 32 if LONG else 12
    bound = 0.05 if LONG else 0.10
    points = 10
    rng = random.Random(1234)
    pids = {"frontend": server.ps.pid, "engine": server.engine_pid}
    samples: dict[str, list[float]] = {name: [] for name in pids}
    outcomes: list[str] = []

    def sample() -> None:
        for name, pid in pids.items():
            samples[name].append(_rss_mib(pid))

    done = 0  # counted here, not from `outcomes`: a client appends before its stream closes

    async def run() -> None:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            async def one(i: int) -> None:
                nonlocal done
                async with sem:
                    await _soak_client(http, random.Random(rng.random()), outcomes)
                done += 1
                if done % (total // points) == 0 and done < total:
                    sample()
            await asyncio.gather(*(one(i) for i in range(total)))

    asyncio.run(run())
    assert len(outcomes) == total
    assert outcomes.count("aborted") > 0 and outcomes.count("finished") > total // 2
    wait_for_idle(server.url)
    sample()  # the 10th point: every request done, every block free
    assert metric(server.url, "kvflow:num_requests_running") == 0
    assert metric(server.url, "kvflow:num_requests_waiting") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
    log = server.output()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]
    report = []
    for name, rss in samples.items():
        assert len(rss) == points, rss
        growth = max(rss[1:]) / rss[0] - 1
        report.append(f"{name} RSS MiB at each tenth: {' '.join(f'{x:.0f}' for x in rss)}; "
                      f"max growth after warm-up {growth:+.1%}")
    print("\n" + "\n".join(report))
    for name, rss in samples.items():
        growth = max(rss[1:]) / rss[0] - 1
        assert growth < bound, f"{name} RSS grew {growth:.1%} (bound {bound:.0%}): {rss}"


# -- the engine killed mid-load (runs last: it ends its own server) --------------------------

def test_engine_sigkill_with_streams_in_flight_fails_fast_and_exits_nonzero():
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs", "4")
    try:
        body = {"prompt": "Count to one hundred:", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        results: dict[int, tuple[str, float]] = {}
        killed_at: list[float] = []

        async def stream(i: int, http: httpx.AsyncClient, started: asyncio.Event) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                last = ""
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        started.set()
                        if line != "data: [DONE]":
                            last = line
                results[i] = (last, time.monotonic())

        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                events = [asyncio.Event() for _ in range(6)]
                tasks = [asyncio.create_task(stream(i, http, e)) for i, e in enumerate(events)]
                while sum(e.is_set() for e in events) < 4:  # 4 running (any 4), 2 waiting
                    await asyncio.sleep(0.02)
                os.kill(srv.engine_pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
                await asyncio.gather(*tasks)

        asyncio.run(run())
        assert len(results) == 6
        for last, ended in results.values():
            assert json.loads(last[6:]).get("error", {}).get("code") == "engine_dead", (last, results)
            assert ended - killed_at[0] < 2.0
        code = srv.proc.wait(30)
        assert code != 0
        assert "engine core process died" in srv.output()
        assert srv.leftover_children() == []
    finally:
        srv.close()
