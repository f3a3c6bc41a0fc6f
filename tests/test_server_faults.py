"""Faults against a real `kvflow serve` (guarded with --max-waiting-requests): requests that
fail after they were counted, a client that leaves a 2,000-prompt batch, a stopped engine, a
crashed engine, and the WebSocket key. Every case that leaves the server up ends with
`assert_server_clean` (health 200, nothing waiting or running, every block free, a normal
completion works). Time limits here are hang guards, never speed targets."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import psutil
import pytest
import websockets
import websockets.exceptions

from server_helpers import ServerProcess, assert_server_clean, metric_value

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GUARD_S = 60  # a hang guard


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "256", "--max-num-seqs", "4",
                        "--max-waiting-requests", "2500")
    yield srv
    srv.close()


def wait_until(condition, what: str, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout}s"
        time.sleep(0.05)


def stream_lines(url: str, body: dict, headers: dict | None = None):
    """The `data:` lines of a streamed completion, as a generator (the first read starts it)."""
    with httpx.Client(base_url=url, headers=headers or {}, timeout=GUARD_S) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield line[6:]


# -- requests that fail after registration ---------------------------------------------------
UNSENDABLE = [
    # each reaches the engine client only if validation lets it through; either way it must
    # come back as a 400, and never stay counted
    {"prompt": "hi", "max_tokens": 2, "n": 128, "seed": 18446744073709551615},
    {"prompt": "hi", "max_tokens": 2, "n": 128, "stop": "\ud800"},
    {"prompt": "hi", "max_tokens": 2, "n": 128, "stop_token_ids": [2 ** 70]},
    {"prompt": "hi", "max_tokens": 2, "n": 128, "top_k": 2 ** 70},
]


def test_failed_requests_never_stay_counted_as_waiting(server):
    """20 x n=128 leaked core requests would be 2,560 waiting, over the limit of 2,500."""
    with httpx.Client(base_url=server.url, timeout=GUARD_S) as http:
        for i in range(20):
            raw = json.dumps(UNSENDABLE[i % len(UNSENDABLE)])  # \ud800 stays a lone surrogate
            resp = http.post("/v1/completions", content=raw,
                             headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["message"]
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 4})
        assert ok.status_code == 200, ok.text
    assert_server_clean(server)


def test_a_client_that_leaves_a_2000_prompt_batch_leaves_nothing_behind(server):
    body = json.dumps({"prompt": [f"{PROMPT} {i}" for i in range(2000)], "max_tokens": 16,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=GUARD_S) as sock:
        sock.sendall(head + body)
        wait_until(lambda: metric_value(server.url, "kvflow:num_requests_waiting") > 100,
                   "the batch never reached the engine")
    # the socket is closed: the server must abort all 2,000 and return every block
    assert_server_clean(server, timeout=GUARD_S * 2)


# -- a stopped engine: the heartbeat -------------------------------------------------------
def test_a_stopped_engine_turns_health_503_and_ends_streams():
    stall_s = 3
    srv = ServerProcess("--max-model-len", "2048", "--num-blocks", "160",
                        "--max-waiting-requests", "8", "--engine-stall-timeout", str(stall_s))
    pid = srv.engine_pid
    try:
        # long enough to be still streaming when the engine is stopped
        lines = stream_lines(srv.url, {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
                                       "stream": True})
        assert json.loads(next(lines))["choices"]
        time.sleep(stall_s + 1)  # a live engine keeps the heartbeat going while it streams
        assert httpx.get(f"{srv.url}/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        health = None
        while health is None or health.status_code != 503:
            assert time.monotonic() - stopped < stall_s + GUARD_S, "/health still 200"
            health = httpx.get(f"{srv.url}/health", timeout=GUARD_S)
            time.sleep(0.05)
        err = health.json()["error"]
        assert err["code"] == "engine_stalled" and err["type"] == "service_unavailable_error"
        assert "Traceback" not in health.text and len(err["message"]) < 300
        rest = list(lines)  # the stream ends (it does not hang)
        assert time.monotonic() - stopped < stall_s + GUARD_S
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_stalled"
        # the stalled engine is not trusted again: it was killed, and the server exits
        assert srv.proc.wait(GUARD_S) != 0
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert srv.leftover_children() == []
        assert "made no progress for 3s" in srv.output()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        srv.close()


# -- a crashed engine: its traceback stays in the log ----------------------------------------
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection")
CRASH_STOP = "kvflow-test: crash the engine core"  # as in fault_injection/sitecustomize.py


def test_health_after_an_engine_crash_shows_no_traceback(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]))
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64")
    try:
        with httpx.Client(base_url=srv.url, timeout=GUARD_S) as http:
            assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
            crash = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                       "stop": [CRASH_STOP]})
            assert crash.status_code == 503, crash.text
            assert "Traceback" not in crash.text and 'File "' not in crash.text
            health = http.get("/health")
        assert health.status_code == 503
        err = health.json()["error"]
        assert err["code"] == "engine_dead"
        assert "Traceback" not in health.text and 'File "' not in health.text
        assert err["message"].endswith("ZeroDivisionError: injected fault in the engine core")
        assert srv.proc.wait(GUARD_S) != 0
        log = srv.output()
        assert "Traceback" in log and "sitecustomize.py" in log  # the detail is in the log
        assert srv.leftover_children() == []
    finally:
        srv.close()


# -- the WebSocket key ---------------------------------------------------------------------
KEY = "kvflow-test-key-5f2c9e"


def test_websocket_key_by_header_or_first_message_never_in_the_log():
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64",
                        "--max-waiting-requests", "8", "--api-key", KEY, "--access-log")
    auth = {"Authorization": f"Bearer {KEY}"}
    ws_url = srv.url.replace("http", "ws") + "/v1/ws"
    request = {"id": "a", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

    async def complete(ws) -> str:
        await ws.send(json.dumps(request))
        text = ""
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), GUARD_S))
            if msg["type"] == "chunk":
                text += msg["data"]["choices"][0]["text"]
            else:
                assert msg["type"] == "done", msg
                return text

    async def by_header() -> str:
        async with websockets.connect(ws_url, additional_headers=auth) as ws:
            return await complete(ws)

    async def by_first_message(key: str) -> str:
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            return await complete(ws)

    async def by_url() -> str:
        async with websockets.connect(f"{ws_url}?api_key={KEY}") as ws:
            return await complete(ws)

    try:
        expected = httpx.post(f"{srv.url}/v1/completions", headers=auth, timeout=GUARD_S,
                              json={k: v for k, v in request.items() if k != "id"}).json()
        expected = expected["choices"][0]["text"]
        assert asyncio.run(by_header()) == expected
        assert asyncio.run(by_first_message(KEY)) == expected
        for attempt in (by_first_message("wrong"), by_url()):  # the URL is never a credential
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                asyncio.run(attempt)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        # a key in an HTTP URL is not accepted either, and not logged
        assert httpx.get(f"{srv.url}/v1/models?api_key={KEY}").status_code == 401
        assert httpx.get(f"{srv.url}/v1/models?api_key={KEY}", headers=auth).status_code == 200
        assert_server_clean(srv, headers=auth)
        log = srv.output()
        assert "/v1/ws" in log and "/v1/models" in log  # the lines are there...
        assert KEY not in log  # ...without the key
    finally:
        srv.close()
