"""Hostile input against one real `kvflow serve`: every case gets a clear 4xx (or an
`error` frame on /v1/ws for that request only), and after each one the server is clean: /health
200, nothing waiting or running, every KV block free, and an ordinary completion works.

The server runs with --max-waiting-requests, so a request that leaked its registration would
soon turn every later request into a 503, which `assert_server_clean` would see."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import websockets

from server_helpers import ServerProcess, assert_server_clean

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "Name a fruit."}]
TIMEOUT = 120  # a hang guard only


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "128",
                        "--max-num-seqs", "4", "--max-waiting-requests", "4")
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def clean_after_each_case(server):
    yield
    assert_server_clean(server)


@pytest.fixture(scope="module")
def vocab(server) -> int:
    """The model's vocabulary size, as the server names it in its refusal."""
    resp = post(server, "/v1/completions", {"prompt": [10**6]})
    return int(re.search(r"\[0, (\d+)\)", error(resp, 400)["message"]).group(1))


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


def error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def ws_exchange(server, frames: list[str], ids: list[str]) -> dict[str, dict]:
    """Send raw text frames on one socket; the last non-chunk frame of each id (done/error),
    plus the text each streamed."""
    url = server.url.replace("http", "ws") + "/v1/ws"

    async def session():
        async with websockets.connect(url, max_size=None) as ws:
            for f in frames:
                await ws.send(f)
            ends, texts = {}, {}
            while set(ids) - set(ends):
                msg = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                if msg["type"] == "chunk":
                    c = msg["data"]["choices"]
                    if c:
                        texts[msg["id"]] = texts.get(msg["id"], "") + (
                            c[0].get("text") or c[0].get("delta", {}).get("content") or "")
                else:
                    ends[msg["id"]] = msg
            return {i: {**ends[i], "text": texts.get(i, "")} for i in ids}

    return asyncio.run(session())


def completion(**kw) -> dict:
    return {"prompt": "The capital of France is", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **kw}


# -- item 1: ids outside the vocabulary --------------------------------------------------------

def test_the_issues_exact_body_is_a_400_and_the_engine_lives(server):
    raw = b'{"prompt":"hi","max_tokens":2,"min_tokens":1,"stop_token_ids":[1000000]}'
    err = error(post(server, "/v1/completions", raw))
    assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"]


def id_cases(vocab: int) -> list[tuple[str, dict, str]]:
    return [
        ("/v1/completions", completion(prompt=[1, 2, vocab]), "prompt"),
        ("/v1/completions", completion(prompt=[[1, 2], [3, vocab + 5]]), "prompt"),
        ("/v1/completions", completion(prompt=[1, -1]), "prompt"),
        ("/v1/completions", completion(stop_token_ids=[vocab]), "stop_token_ids"),
        ("/v1/completions", completion(stop_token_ids=[5, -1]), "stop_token_ids"),
        ("/v1/completions", completion(logit_bias={str(vocab): 5}), "logit_bias"),
        ("/v1/completions", completion(logit_bias={"-3": 5}), "logit_bias"),
        ("/v1/completions", completion(top_k=vocab + 1), "top_k"),
        ("/v1/chat/completions", chat(stop_token_ids=[vocab]), "stop_token_ids"),
        ("/v1/chat/completions", chat(logit_bias={str(vocab + 100): -5}), "logit_bias"),
        ("/v1/chat/completions", chat(top_k=vocab + 1), "top_k"),
        ("/detokenize", {"tokens": [1, vocab]}, "tokens"),
    ]


def test_out_of_range_ids_in_every_id_field_are_refused_by_name(server, vocab):
    for path, body, field in id_cases(vocab):
        err = error(post(server, path, body))
        assert err["param"] == field, (path, body, err)
    # the last id of the vocabulary is fine
    ok = post(server, "/v1/completions", completion(prompt=[1, vocab - 1], stop_token_ids=[vocab - 1],
                                                    logit_bias={str(vocab - 1): 1}))
    assert ok.status_code == 200, ok.text


def test_out_of_range_ids_over_the_websocket_end_only_that_request(server, vocab):
    cases = [(f"bad{i}", body, field) for i, (path, body, field) in enumerate(id_cases(vocab))
             if path != "/detokenize"]
    frames = [json.dumps({"id": rid, **body}) for rid, body, _ in cases]
    frames.append(json.dumps({"id": "good", **completion()}))
    ends = ws_exchange(server, frames, [rid for rid, _, _ in cases] + ["good"])
    for rid, _, field in cases:
        assert ends[rid]["type"] == "error" and ends[rid]["error"]["param"] == field, ends[rid]
    assert ends["good"]["type"] == "done" and ends["good"]["text"]


# -- item 2: values that used to fail to encode, and leak ----------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_values_past_64_bits_are_refused_before_the_engine(server, path):
    make = completion if path == "/v1/completions" else chat
    for _ in range(6):  # more than --max-waiting-requests: a leak would show as 503s
        for body, field in [(make(seed=2**64 - 1, n=2), "seed"), (make(seed=2**64), "seed"),
                            (make(top_k=2**70), "top_k"), (make(stop_token_ids=[2**70]), "stop_token_ids"),
                            (make(max_tokens=2**70), "max_tokens"), (make(min_tokens=2**70), "min_tokens"),
                            (make(priority=2**70), "priority"), (make(n=2**70), "n"),
                            (make(logit_bias={str(2**70): 1}), "logit_bias")]:
            assert error(post(server, path, body))["param"] == field, body
    ok = post(server, path, make(seed=2**64 - 2, n=2))  # seed + 1 still fits in 64 bits
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


LONE = r"\ud800"  # a JSON escape: the parsed string holds a lone surrogate


def surrogate_bodies() -> list[tuple[str, bytes, str]]:
    return [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["' + LONE.encode() + b'"]}', "stop"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": "' + LONE.encode() + b'"}', "stop"),
        ("/v1/completions", b'{"prompt": "hi ' + LONE.encode() + b'", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "' + LONE.encode() + b'"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "user": "' + LONE.encode() + b'"}', "user"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "model": "' + LONE.encode() + b'"}', "model"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + LONE.encode()
         + b'"}], "max_tokens": 2}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "'
         + LONE.encode() + b'"}]}], "max_tokens": 2}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
         b'"stop": ["' + LONE.encode() + b'"]}', "stop"),
        ("/tokenize", b'{"prompt": "' + LONE.encode() + b'"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "' + LONE.encode() + b'"}]}', "messages"),
    ]


def test_lone_surrogates_are_a_400_on_every_endpoint(server):
    for _ in range(2):  # more than --max-waiting-requests in all
        for path, raw, field in surrogate_bodies():
            err = error(post(server, path, raw))
            assert err["param"] == field and "unicode" in err["message"].lower(), (path, err)


def test_lone_surrogates_over_the_websocket_are_an_error_frame_for_that_request(server):
    frames, ids = [], []
    for i, (path, raw, field) in enumerate(surrogate_bodies()):
        if path == "/tokenize":
            continue
        body = raw.decode()
        frames.append('{"id": "bad%d", ' % i + body[1:])
        ids.append(f"bad{i}")
    frames.append(json.dumps({"id": "good", **chat()}))
    # a lone surrogate in the id itself: answered without an id, the socket stays up
    frames.append('{"id": "' + LONE + '", "prompt": "hi"}')
    ends = ws_exchange(server, frames, ids + ["good", None])
    for rid in ids:
        assert ends[rid]["type"] == "error" and "unicode" in ends[rid]["error"]["message"].lower()
    assert ends["good"]["type"] == "done" and ends["good"]["text"]
    assert ends[None]["error"]["param"] == "id"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("top_p", "Infinity"),
                                          ("presence_penalty", "-Infinity"), ("seed", "NaN"),
                                          ("max_tokens", "Infinity"), ("n", "NaN")])
def test_nan_and_infinity_in_numeric_fields_are_a_400(server, path, field, value):
    head = b'{"prompt": "hi"' if path == "/v1/completions" else b'{"messages": [{"role": "user", "content": "hi"}]'
    raw = head + b', "' + field.encode() + b'": ' + value.encode() + b"}"
    assert error(post(server, path, raw))["param"] == field


def test_nan_logit_bias_is_a_400(server):
    err = error(post(server, "/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}'))
    assert err["param"] == "logit_bias"


# -- item 3: caps --------------------------------------------------------------------------------

def test_100k_stop_strings_are_refused_naming_the_cap(server):
    for path, make in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        err = error(post(server, path, make(stop=[f"s{i}" for i in range(100_000)])))
        assert err["param"] == "stop" and "at most 64 stop strings" in err["message"]
    err = error(post(server, "/v1/completions", completion(stop=["x" * 5000])))
    assert err["param"] == "stop" and "1024 characters" in err["message"]
    err = error(post(server, "/v1/completions", completion(stop_token_ids=list(range(1000)))))
    assert err["param"] == "stop_token_ids" and "at most 256" in err["message"]


def test_5000_prompts_times_n_128_is_a_fast_400_naming_the_cap(server):
    err = error(post(server, "/v1/completions", {"prompt": ["hi"] * 5000, "n": 128, "max_tokens": 1}))
    assert err["param"] == "n" and "640000 choices" in err["message"] and "4096" in err["message"]
    err = error(post(server, "/v1/completions", {"prompt": ["hi"] * 100_000, "max_tokens": 1}))
    assert err["param"] == "prompt" and "4096" in err["message"]
    err = error(post(server, "/v1/completions", {"prompt": [[7] * 500] * 32, "n": 128, "max_tokens": 1}))
    assert err["param"] == "prompt" and "at most 1048576" in err["message"]
    err = error(post(server, "/v1/chat/completions", {"messages": CHAT * 5000}))
    assert err["param"] == "messages" and "at most 4096" in err["message"]


def test_counts_are_bounded(server):
    for body, field in [(completion(n=129), "n"), (completion(logprobs=21), "logprobs"),
                        (chat(logprobs=True, top_logprobs=21), "logprobs"),
                        (completion(max_tokens=MAX_MODEL_LEN), "max_tokens"),
                        (completion(logit_bias={str(i): 1 for i in range(301)}), "logit_bias")]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert error(post(server, path, body))["param"] == field, body


# -- item 7: logit_bias, unimplemented fields, /tokenize, the WebSocket ---------------------------

def test_logit_bias_forces_and_bans_tokens_end_to_end(server):
    forced = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                        timeout=TIMEOUT).json()["tokens"]
    assert len(forced) == 1
    banana = forced[0]
    body = completion(max_tokens=3, temperature=0, logit_bias={str(banana): 100})
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == " banana" * 3
    resp = post(server, "/v1/chat/completions", chat(max_tokens=3, logit_bias={str(banana): 100}))
    assert resp.json()["choices"][0]["message"]["content"].strip() == "banana banana banana"

    plain = post(server, "/v1/completions", completion(max_tokens=1, temperature=0, logprobs=0)).json()
    first = plain["choices"][0]["text"]
    top = httpx.post(f"{server.url}/tokenize", json={"prompt": first, "add_special_tokens": False},
                     timeout=TIMEOUT).json()["tokens"]
    banned = post(server, "/v1/completions", completion(max_tokens=1, temperature=0,
                                                       logit_bias={str(top[0]): -100})).json()
    assert banned["choices"][0]["text"] != first

    ends = ws_exchange(server, [json.dumps({"id": "b", **completion(
        max_tokens=3, temperature=0, logit_bias={str(banana): 100})})], ["b"])
    assert ends["b"]["type"] == "done" and ends["b"]["text"] == " banana" * 3


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "!"}, "suffix"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
])
def test_known_but_unimplemented_fields_are_a_400_naming_them(server, path, extra, field):
    body = {**(completion() if path == "/v1/completions" else chat()), **extra}
    err = error(post(server, path, body))
    assert err["param"] == field and "does not implement" in err["message"]


def test_their_defaults_are_accepted(server):
    for body in (completion(best_of=1), completion(n=2, best_of=2),
                 chat(response_format={"type": "text"}), completion(some_future_field=1)):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        resp = post(server, path, body)
        assert resp.status_code == 200, resp.text


def test_tokenize_refuses_oversized_input_before_the_work(server):
    limit = MAX_MODEL_LEN * 64
    err = error(post(server, "/tokenize", {"prompt": "a" * (limit + 1)}))
    assert err["param"] == "prompt" and str(limit) in err["message"]
    err = error(post(server, "/tokenize", {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}))
    assert err["param"] == "messages"
    err = error(post(server, "/tokenize", {"messages": CHAT * 4097}))
    assert err["param"] == "messages" and "4096" in err["message"]
    # just under the limit: tokenized (off the event loop) and counted
    resp = post(server, "/tokenize", {"prompt": "word " * (limit // 5)})
    assert resp.status_code == 200 and resp.json()["count"] > MAX_MODEL_LEN
    err = error(post(server, "/v1/completions", completion(prompt="a" * (limit + 1))))
    assert err["param"] == "prompt"


def test_websocket_survives_deep_nesting_bad_frames_and_binary_frames(server):
    url = server.url.replace("http", "ws") + "/v1/ws"

    async def session():
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send("[" * 100_000 + "]" * 100_000)
            deep = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            await ws.send('{"id": "d", "prompt": "hi", "stop": ' + "[" * 50_000 + "]" * 50_000 + "}")
            deep_field = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            await ws.send(b"\xff\xfe not utf-8")
            binary = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            await ws.send(json.dumps({"id": "ok", **completion()}).encode())
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                if msg["type"] != "chunk":
                    return deep, deep_field, binary, msg

    deep, deep_field, binary, last = asyncio.run(session())
    assert deep["type"] == "error" and "nested too deeply" in deep["error"]["message"]
    assert deep_field["type"] == "error" and "nested too deeply" in deep_field["error"]["message"]
    assert binary["type"] == "error" and "UTF-8" in binary["error"]["message"]
    assert last == {"type": "done", "id": "ok"}


def test_integers_of_thousands_of_digits_are_a_400(server):
    digits = b"7" * 5000
    for path, head in (("/v1/completions", b'{"prompt": "hi", "seed": '),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": ')):
        error(post(server, path, head + digits + b"}"))
    error(post(server, "/detokenize", b'{"tokens": [' + digits + b"]}"))


def test_big_text_prompts_are_tokenized_off_the_loop_and_still_checked(server):
    text = "word " * 4000  # over the inline size: the tokenizer thread does it
    err = error(post(server, "/v1/completions", completion(prompt=[text, "hi"])))
    assert err["param"] == "max_tokens" and "max_model_len" in err["message"]
    err = error(post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": text}])))
    assert "max_model_len" in err["message"]
    # 9,000 spaces are ~142 tokens: long enough for the thread, short enough to run
    ok = post(server, "/v1/completions", completion(prompt="Hello" + " " * 9000, max_tokens=1))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    ok = post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": " " * 9000 + "Hi"}]))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]
