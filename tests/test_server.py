"""`kvflow serve` end to end: a real server subprocess with the default model, driven by the
official `openai` client, httpx and a WebSocket client."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
import websockets
import websockets.exceptions

from server_helpers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three fruits."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "512")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def wait_for_idle_blocks(url: str, timeout: float = 10.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        free, total = metric(url, "kvflow:num_free_blocks"), metric(url, "kvflow:num_total_blocks")
        if free == total or time.monotonic() > deadline:
            return free, total
        time.sleep(0.1)


def counts(usage) -> tuple[int, int, int]:
    """Token counts of a usage object; cached_tokens differs once a prompt is in the cache."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


# -- completions and chat ------------------------------------------------------------
def test_completion_stream_joins_to_the_non_streamed_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens + last.usage.completion_tokens == last.usage.total_tokens
    assert counts(last.usage) == counts(whole.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_joins_to_the_non_streamed_message(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_max_completion_tokens_caps_a_chat_reply(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n_3_with_seed_gives_three_reproducible_choices(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=42)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "the three samples should differ"
    chunks = list(client.completions.create(**kw, stream=True))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == first.choices[i].text
        assert sum(c.finish_reason is not None for c in mine) == 1


def test_usage_counts_prompt_once_and_tokens_of_every_choice(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    assert out.usage.completion_tokens == 10


def test_prompt_forms_strings_and_token_ids(client, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    two = client.completions.create(prompt=[ids, ids], **kw)
    assert [c.text for c in two.choices] == [by_text, by_text]
    two = client.completions.create(prompt=[PROMPT, "1, 2, 3,"], **kw)
    assert two.choices[0].text == by_text and len(two.choices) == 2


def test_completion_logprobs_have_the_legacy_shape(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logprobs=3, echo=True)
    choice, lp = out.choices[0], out.choices[0].logprobs
    n = out.usage.completion_tokens
    p = out.usage.prompt_tokens  # echo: the prompt's tokens come first, the first one unscored
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) >= 3 for top in lp.top_logprobs[p:])
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(top.values()) - x) < 1e-4
               for top, x in zip(lp.top_logprobs[p:], lp.token_logprobs[p:]))
    assert lp.text_offset[p] == len(PROMPT) and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string_ends_the_text_before_it(client):
    kw = dict(model=MODEL, prompt="List the days of the week: Monday, Tuesday,", max_tokens=24,
              temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full.strip()[4:8]
    assert stop
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_sixteen_concurrent_streaming_clients_all_get_their_text(client, aclient):
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "My favourite colour is"]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                .choices[0].text for p in prompts}

    async def one(prompt: str) -> tuple[str, str]:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                  temperature=0, stream=True)
        return prompt, "".join([c.choices[0].text async for c in stream])

    async def all16():
        return await asyncio.gather(*(one(prompts[i % 4]) for i in range(16)))

    results = asyncio.run(all16())
    assert len(results) == 16
    for prompt, text in results:
        assert text == expected[prompt], prompt


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    free_idle, total = wait_for_idle_blocks(server.url)
    assert free_idle == total
    generated = metric(server.url, "kvflow:generation_tokens_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(5):
                assert next(lines).startswith("data: ")
                next(lines)  # blank separator
            assert metric(server.url, "kvflow:num_free_blocks") < free_idle
    # Closed mid-stream: the request leaves the batch and its blocks return to the pool.
    assert wait_for_idle_blocks(server.url) == (free_idle, total)
    assert metric(server.url, "kvflow:num_requests_running") == 0
    assert metric(server.url, "kvflow:generation_tokens_total") - generated < 400  # cut short


def test_client_that_gives_up_on_a_non_streamed_request_frees_its_blocks(server):
    free_idle, total = wait_for_idle_blocks(server.url)
    generated = metric(server.url, "kvflow:generation_tokens_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    assert wait_for_idle_blocks(server.url) == (free_idle, total)
    assert metric(server.url, "kvflow:generation_tokens_total") - generated < 400  # cut short


def test_tokenize_matches_the_tokenizer_and_detokenize_inverts_it(server, default_tokenizer):
    text = "Hello, wörld! 東京 🎉"
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == default_tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    rendered = default_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == default_tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == default_tokenizer.decode(got["tokens"])


def test_models_health_version_and_metrics(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_free_blocks", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "request_success_total"):
        assert f"kvflow:{name}" in text, name
    assert metric(server.url, "kvflow:generation_tokens_total") > 0


# -- WebSocket -------------------------------------------------------------------------
def test_websocket_streams_two_requests_at_once_and_cancels_one(server, client):
    expected = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=0).choices[0].text
    ws_url = server.url.replace("http", "ws") + "/v1/ws"

    async def session():
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"id": "a", "type": "completion", "prompt": PROMPT,
                                      "max_tokens": 16, "temperature": 0}))
            await ws.send(json.dumps({"id": "b", "messages": CHAT, "max_tokens": 400,
                                      "ignore_eos": True}))
            texts, ends, cancel_sent = {"a": "", "b": ""}, {}, False
            while len(ends) < 2:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "chunk":
                    choice = msg["data"]["choices"][0]
                    texts[msg["id"]] += choice.get("text") or choice.get("delta", {}).get("content") or ""
                    if msg["id"] == "b" and not cancel_sent:
                        await ws.send(json.dumps({"type": "cancel", "id": "b"}))
                        cancel_sent = True
                else:
                    ends[msg["id"]] = msg["type"]
            return texts, ends

    texts, ends = asyncio.run(session())
    assert ends == {"a": "done", "b": "cancelled"}
    assert texts["a"] == expected
    free, total = wait_for_idle_blocks(server.url)
    assert free == total


def test_websocket_reports_a_bad_request_on_that_request_only(server):
    ws_url = server.url.replace("http", "ws") + "/v1/ws"

    async def session():
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"id": "bad", "prompt": PROMPT, "temperature": -1}))
            await ws.send(json.dumps({"id": "ok", "prompt": PROMPT, "max_tokens": 2}))
            seen = {}
            while len(seen) < 2:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] != "chunk":
                    seen[msg["id"]] = msg
            return seen

    seen = asyncio.run(session())
    assert seen["bad"]["type"] == "error" and "temperature" in seen["bad"]["error"]["message"]
    assert seen["ok"]["type"] == "done"


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -0.5}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    ({"prompt": PROMPT, "n": 0}, 400, "n must"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ({"prompt": "word " * 600, "max_tokens": 200}, 400, f"max_model_len {MAX_MODEL_LEN}"),
    ({"prompt": PROMPT, "model": "no-such-model"}, 404, "no-such-model"),
    ({}, 400, "prompt"),
])
def test_bad_completion_requests_get_openai_shaped_errors(server, body, status, needle):
    err = assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body), status)
    assert needle in err["message"]


def test_prompt_over_max_model_len_names_the_numbers(server):
    body = {"prompt": "word " * 600, "max_tokens": 200}
    err = assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    n = int(re.search(r"prompt has (\d+) tokens", err["message"]).group(1))
    assert n > MAX_MODEL_LEN and "max_tokens is 200" in err["message"] and err["param"] == "max_tokens"


def test_bad_chat_requests_get_openai_shaped_errors(server, client):
    url = f"{server.url}/v1/chat/completions"
    assert_openai_error(httpx.post(url, json={"messages": []}), 400)
    assert_openai_error(httpx.post(url, json={"messages": "hi"}), 400)
    assert_openai_error(httpx.post(url, json={"messages": CHAT, "top_logprobs": 2}), 400)
    assert_openai_error(httpx.post(url, content=b"{not json",
                                   headers={"content-type": "application/json"}), 400)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"top_k": -5})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_body_over_the_size_limit_is_413(server):
    resp = httpx.post(f"{server.url}/v1/completions", content=b"x" * (9 * 2**20),
                      headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(resp, 413)


def test_unknown_fields_are_ignored_but_unimplemented_ones_are_refused(server):
    """As OpenAI does, a field nobody defines is ignored; a field OpenAI or vLLM defines and
    kvflow does not implement is a 400 naming it (its default value is fine)."""
    body = {"prompt": PROMPT, "max_tokens": 2, "best_of": 1, "logit_bias": {}, "user": "u",
            "response_format": {"type": "text"}, "some_future_field": {"x": 1}}
    resp = httpx.post(f"{server.url}/v1/completions", json=body)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]
    for field, value in [("best_of", 3), ("use_beam_search", True), ("suffix", "!")]:
        err = assert_openai_error(httpx.post(f"{server.url}/v1/completions",
                                             json={**body, field: value}), 400)
        assert err["param"] == field and "does not implement" in err["message"]


def test_sigterm_ends_streams_with_503_and_stops_server_and_engine():
    """Its own server: the module's one stays up for the tests after this one."""
    server = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "64")
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        assert server.proc.wait(30) == 0
        assert server.leftover_children() == []
    finally:
        server.close()


# -- a second, guarded server: API key, back-pressure, engine death -------------------
@pytest.fixture(scope="module")
def guarded():
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--api-key", "s3cret",
                        "--served-model-name", "guarded", "also-guarded")
    yield srv
    srv.close()


def test_api_key_is_required_except_for_health_and_metrics(guarded):
    url = f"{guarded.url}/v1/completions"
    body = {"model": "also-guarded", "prompt": PROMPT, "max_tokens": 2}
    assert_openai_error(httpx.post(url, json=body), 401)
    assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200
    ok = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="s3cret", max_retries=0)
    assert [m.id for m in ok.models.list().data] == ["guarded", "also-guarded"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0).models.list()

    async def ws_without_key():
        async with websockets.connect(guarded.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.recv()

    with pytest.raises(websockets.exceptions.WebSocketException):
        asyncio.run(ws_without_key())


def test_requests_beyond_max_waiting_get_503_with_a_retry_hint(guarded):
    headers = {"Authorization": "Bearer s3cret"}
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.aiter_lines()  # kept: dropping it would close the stream
                await anext(lines)  # running (max_num_seqs is 1)
                async with http.stream("POST", "/v1/completions", json=body) as second:
                    assert second.status_code == 200  # it waits: one waiting is allowed
                    while metric(guarded.url, "kvflow:num_requests_waiting") != 1:
                        await asyncio.sleep(0.05)
                    third = await http.post("/v1/completions", json={**body, "stream": False})
            return third

    third = asyncio.run(run())
    assert_openai_error(third, 503)
    assert third.headers.get("retry-after")
    assert "max_waiting_requests" in third.json()["error"]["message"]


def test_killing_the_engine_fails_requests_and_health():
    """Its own server (the test ends it), so no test depends on running before or after it."""
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(srv.engine_pid, signal.SIGKILL)
                deadline = time.monotonic() + 60  # a hang guard, not a speed target
                while http.get("/health").status_code != 503:
                    assert time.monotonic() < deadline, "/health still OK 60 s after the engine died"
                    time.sleep(0.05)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        # The frontend then exits by itself (non-zero) and leaves nothing behind.
        assert srv.proc.wait(30) != 0
        assert srv.leftover_children() == []
    finally:
        srv.close()
