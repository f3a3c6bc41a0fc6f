"""Prefill/decode disaggregation end to end: a prefill instance (kv_producer), a decode instance
(kv_consumer) and `kvflow router` in front, all real processes on a tiny random Llama in fp32.

Greedy outputs through the router equal a single engine's; the traces show that the prefill
instance never decodes and the decode instance computes one prompt token per transferred
request; and each fault (an abort while the K/V is pulled, a router process SIGKILLed after the
prefill, a compatibility mismatch, a killed decode instance, a killed prefill instance, 64
concurrent requests with failing transfers) ends with every block free again on both sides and
/health 200. Faults are timed by the fault-injection hook (tests/fault_injection), not by luck.
Time limits here are hang guards."""
from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from conftest_model_helpers import _save_random
from server_helpers import REPO, ServerProcess, free_port, metric_value
from kvflow.kv_transfer import messages as m
from kvflow.kv_transfer import shm
from kvflow.utils.process import die_with_parent

pytestmark = pytest.mark.slow

FAULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection")
BLOCK, CHUNK = 16, 64
COMMON = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks", "128",
          "--block-size", str(BLOCK), "--max-num-batched-tokens", str(CHUNK)]
LEASE_S, LOAD_TIMEOUT_S = 3.0, 3.0
GUARD_S = 60


def wait_until(cond, what: str, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not after {timeout}s"
        time.sleep(0.05)


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_role": role, "kv_port": free_port(), "kv_lease_timeout_s": LEASE_S,
                       "kv_load_timeout_s": LOAD_TIMEOUT_S, **extra})


class Cluster:
    def __init__(self, model: str, tmp: str) -> None:
        self.faults = os.path.join(tmp, "faults.json")
        self.set_faults()
        os.environ["KVTEST_KV_FAULTS"] = self.faults
        os.environ["PYTHONPATH"] = os.pathsep.join([FAULTS_DIR, os.environ.get("PYTHONPATH", "")])
        self.p_trace, self.d_trace = os.path.join(tmp, "p.jsonl"), os.path.join(tmp, "d.jsonl")
        self.model = model
        self.prefill = ServerProcess("--model", model, *COMMON, "--trace", self.p_trace,
                                     "--kv-transfer-config", kv_config("kv_producer"))
        self.decode = ServerProcess("--model", model, *COMMON, "--trace", self.d_trace,
                                    "--kv-transfer-config", kv_config("kv_consumer"))
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.router = subprocess.Popen(
            [sys.executable, "-m", "kvflow.entrypoints.cli", "router", "--port",
             str(self.router_port), "--prefill", self.prefill.url, "--decode", self.decode.url],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
        wait_until(lambda: _ok(self.router_url + "/health"), "router up")

    def set_faults(self, **faults) -> None:
        with open(self.faults, "w") as f:
            json.dump(faults, f)

    def close(self) -> None:
        self.router.terminate()
        self.router.wait(10)
        for s in (self.prefill, self.decode):
            s.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def assert_clean(*servers: ServerProcess) -> None:
    """Every block back in the pool (no lease, no pull left), /health 200."""
    for s in servers:
        def clean():
            free = metric_value(s.url, "kvflow:num_free_blocks")
            total = metric_value(s.url, "kvflow:num_total_blocks")
            return (free == total and metric_value(s.url, "kvflow:kv_transfer_leases_active") == 0
                    and metric_value(s.url, "kvflow:kv_transfer_loads_active") == 0)
        wait_until(clean, f"{s.url}: blocks back")
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("pd") / "tiny-pd")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(default_tokenizer), max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    old = {k: os.environ.get(k) for k in ("KVTEST_KV_FAULTS", "PYTHONPATH")}
    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("pd-run")))
    yield c
    c.close()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


# shorter than, equal to and one past a block; P-1 on a block boundary; longer than the chunk
LENGTHS = [5, 16, 17, 33, 49, 150]
BASE = prompts_of(LENGTHS)
SHARED = [BASE[-1][:96] + p for p in prompts_of([20, 40], seed=1)]  # a 96-token prefix hit
MAX_TOKENS = 12
FRESH = prompts_of([120], seed=9)[0]
# for a TP=2 instance on either side: fresh prompts (no prefix hit skips the pull), around
# block multiples and past the chunk
TP_LENGTHS = [15, 16, 17, 48, 49, 150]
TP_PREFILL, TP_DECODE = prompts_of(TP_LENGTHS, seed=21), prompts_of(TP_LENGTHS, seed=22)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """A single engine's greedy tokens (fp32, the same block size and chunk)."""
    from kvflow import LLM, SamplingParams

    llm = LLM(tiny_model, dtype="float32", max_model_len=512, num_blocks=128, block_size=BLOCK,
              max_num_batched_tokens=CHUNK, num_threads=1)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = (BASE + SHARED + prompts_of([24] * 64, seed=2) + [FRESH] + TP_PREFILL
                   + TP_DECODE)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
    finally:
        llm.engine.shutdown()


def complete(url: str, prompt, timeout=GUARD_S, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw})


def tokens_of(resp: httpx.Response, tokenizer) -> list[int]:
    assert resp.status_code == 200, resp.text
    return tokenizer.encode(resp.json()["choices"][0]["text"], add_special_tokens=False)


def routed_tokens(cluster, prompt, tokenizer, **kw) -> str:
    resp = complete(cluster.router_url, prompt, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def ref_text(reference, prompt, tokenizer) -> str:
    return tokenizer.decode(reference[tuple(prompt)])


def test_routed_greedy_outputs_equal_a_single_instance(cluster, reference, default_tokenizer):
    tok = default_tokenizer
    # cold: no prefix hit anywhere
    for p in BASE:
        assert routed_tokens(cluster, p, tok) == ref_text(reference, p, tok), len(p)
    # again: the prefill side hits its prefix cache, the decode side its own (pulled) blocks
    for p in BASE:
        assert routed_tokens(cluster, p, tok) == ref_text(reference, p, tok), len(p)
    # partial prefix hits on both sides, and streamed
    for p in SHARED:
        with httpx.stream("POST", cluster.router_url + "/v1/completions", timeout=GUARD_S, json={
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert text == ref_text(reference, p, tok)
    assert metric_value(cluster.decode.url, "kvflow:kv_transfer_loads_done_total") >= len(BASE)
    assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_bytes_sent_total") > 0
    # chat goes the same way; the router's own endpoints answer
    chat = httpx.post(cluster.router_url + "/v1/chat/completions", timeout=GUARD_S, json={
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(cluster.router_url + "/v1/models").json()["data"]
    assert "kvflow_router:requests_total" in httpx.get(cluster.router_url + "/metrics").text
    assert_clean(cluster.prefill, cluster.decode)


def test_other_endpoints_in_prefill_decode_mode(cluster):
    """Embeddings (a prompt only) go to a prefill instance, tokenize to any instance, LoRA loads
    to every instance; the Responses and Messages APIs, which the prefill hop cannot carry, are
    refused naming the endpoint and the mode."""
    url = cluster.router_url
    body = {"input": ["embed me through the router", "and me"]}
    routed = httpx.post(url + "/v1/embeddings", json=body, timeout=GUARD_S)
    direct = httpx.post(cluster.prefill.url + "/v1/embeddings", json=body, timeout=GUARD_S)
    assert routed.status_code == direct.status_code == 200, routed.text
    for x, y in zip(routed.json()["data"], direct.json()["data"]):
        assert max(abs(p - q) for p, q in zip(x["embedding"], y["embedding"])) < 1e-5
    tok = {"prompt": "count these tokens"}
    assert httpx.post(url + "/tokenize", json=tok, timeout=GUARD_S).json() == \
        httpx.post(cluster.decode.url + "/tokenize", json=tok).json()
    for path, req in (("/v1/responses", {"input": "hi"}),
                      ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user",
                                                                      "content": "hi"}]})):
        resp = httpx.post(url + path, json=req, timeout=GUARD_S)
        assert resp.status_code == 400, resp.text
        text = resp.text
        assert path in text and "prefill/decode mode" in text
    assert httpx.post(url + "/v1/messages", json={}).json()["type"] == "error"  # Anthropic's shape
    assert httpx.get(url + "/v1/responses/resp_x").status_code == 400
    # these instances do not take adapters at run time: both are asked, both refusals said
    load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                      timeout=GUARD_S)
    msg = load.json()["error"]["message"]
    assert load.status_code >= 400 and cluster.prefill.url in msg and cluster.decode.url in msg


def dashboard_transfers(url: str) -> dict:
    """The transfer counts of the first event of the server's /dashboard/stream."""
    with httpx.stream("GET", url + "/dashboard/stream", timeout=GUARD_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])["kv_transfer"]
    raise AssertionError("the stream ended without an event")


def test_dashboard_shows_the_transfers_of_both_sides(cluster, default_tokenizer):
    routed_tokens(cluster, prompts_of([40], seed=21)[0], default_tokenizer)
    assert_clean(cluster.prefill, cluster.decode)  # the counts below no longer move
    sent = dashboard_transfers(cluster.prefill.url)["prefill"]
    got = dashboard_transfers(cluster.decode.url)["decode"]
    assert sent["pulls_served"] >= 1 and sent["leases_active"] == 0
    assert sent["pulls_served"] == metric_value(cluster.prefill.url,
                                                "kvflow:kv_transfer_pulls_served_total")
    assert sent["bytes_sent"] == metric_value(cluster.prefill.url,
                                              "kvflow:kv_transfer_bytes_sent_total")
    assert got["loads_done"] == metric_value(cluster.decode.url,
                                             "kvflow:kv_transfer_loads_done_total")
    assert got["blocks_received"] == metric_value(cluster.decode.url,
                                                  "kvflow:kv_transfer_blocks_received_total")
    assert got["bytes_received"] > 0 and 0 < got["mean_load_s"] < GUARD_S


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_traces_show_no_decode_on_prefill_and_one_prompt_token_on_decode(cluster):
    prefill_steps = read_trace(cluster.p_trace)
    assert prefill_steps, "the prefill instance traced no step"
    assert all(r["phase"] == "prefill" for s in prefill_steps for r in s["requests"])
    decode_steps = read_trace(cluster.d_trace)
    loaded = {t["id"] for s in decode_steps for t in s.get("kv_transfers", [])
              if t["event"] == "loaded"}
    assert loaded
    prompt_tokens: dict[str, int] = {}
    for s in decode_steps:
        for r in s["requests"]:
            if r["phase"] == "prefill":
                prompt_tokens[r["id"]] = prompt_tokens.get(r["id"], 0) + r["tokens"]
    assert all(prompt_tokens.get(rid, 0) <= 1 for rid in loaded), prompt_tokens
    # `kvflow trace` tells it: blocks lent on one side, pulled and loaded on the other
    from kvflow.trace.reader import load_trace
    from kvflow.trace.table import render
    assert "(lent " in render(load_trace(cluster.p_trace).steps)
    decode_table = render(load_trace(cluster.d_trace).steps)
    assert ": pulling (" in decode_table and ": loaded (" in decode_table


def test_abort_while_waiting_for_remote_kv_frees_both_sides(cluster):
    late_before = metric_value(cluster.decode.url, "kvflow:kv_transfer_late_frames_total")
    cluster.set_faults(delay_s=2.0)  # the pull's answer is held: the client gives up first
    try:
        with pytest.raises(httpx.ReadTimeout):
            complete(cluster.router_url, prompts_of([40], seed=5)[0], timeout=1.0)
    finally:
        cluster.set_faults()
    assert_clean(cluster.prefill, cluster.decode)
    # the held answer arrived after the abort and was dropped
    wait_until(lambda: metric_value(cluster.decode.url, "kvflow:kv_transfer_late_frames_total")
               > late_before, "late frames counted")
    assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_expired_total") == 0


def test_lease_expires_when_nobody_comes_after_the_prefill(cluster):
    """What a router killed right after the prefill leaves behind: a lease nobody pulls."""
    resp = complete(cluster.prefill.url, prompts_of([70], seed=6)[0], max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})
    assert resp.status_code == 200 and resp.json()["kv_transfer_params"]["remote_block_ids"]
    assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_active") == 1
    assert_clean(cluster.prefill, cluster.decode)
    assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_expired_total") == 1


def test_router_killed_after_the_prefill_leaves_a_lease_that_expires(cluster):
    """A real router process, SIGKILLed as soon as the prefill instance has answered it: the
    decode instance's HTTP server is stopped (SIGSTOP) meanwhile, so the router's call to it hangs
    and nobody ever pulls. The prefill side's lease expires, its blocks come back, and once the
    decode instance runs again (it may still read the dead router's request) both are healthy."""
    expired = metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_expired_total")
    proc, url = start_router("--prefill", cluster.prefill.url, "--decode", cluster.decode.url)
    frontend = cluster.decode.proc.pid
    os.kill(frontend, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, url, prompts_of([70], seed=31)[0])
            wait_until(lambda: metric_value(url, "kvflow_router:prefill_seconds_count") == 1,
                       "the prefill instance answered the router")
            assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_active") == 1
            proc.kill()
            proc.wait(10)
            with pytest.raises(httpx.HTTPError):  # the client sees the router vanish
                fut.result(GUARD_S)
        wait_until(lambda: metric_value(cluster.prefill.url,
                                        "kvflow:kv_transfer_leases_expired_total") == expired + 1,
                   "lease expired", timeout=LEASE_S + 5)
        assert_clean(cluster.prefill)
    finally:
        os.kill(frontend, signal.SIGCONT)
    assert_clean(cluster.prefill, cluster.decode)


def test_what_an_instance_cannot_do_is_a_400_naming_it(cluster):
    prompt = prompts_of([10], seed=12)[0]
    resp = complete(cluster.decode.url, prompt, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})
    assert resp.status_code == 400 and "lends no KV blocks" in resp.text, resp.text
    resp = complete(cluster.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True,
                                                                     "remote_tp_size": 2})
    assert resp.status_code == 400 and "remote_tp_size" in resp.text, resp.text
    resp = complete(cluster.router_url, prompt, kv_transfer_params={"do_remote_decode": True})
    assert resp.status_code == 400 and "kv_transfer_params" in resp.text
    assert_clean(cluster.prefill, cluster.decode)


def test_compatibility_mismatch_is_refused_at_both_handshakes(cluster):
    prompt = prompts_of([40], seed=7)[0]
    params = complete(cluster.prefill.url, prompt, max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    # the producer's own check, at the pull: a consumer with a bf16 KV cache is refused
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
    dealer.send_multipart([m.PULL, m.encoder.encode(m.PullRequest(
        params["transfer_id"], params["remote_block_ids"],
        dict(params["compat"], kv_dtype="bfloat16"), "elsewhere"))])
    assert dealer.poll(GUARD_S * 1000)
    frames = dealer.recv_multipart()
    head = m.header_decoder.decode(frames[1])
    assert "kv_dtype 'bfloat16' there, 'float32' here" in head.error, head.error
    dealer.close()
    ctx.term()
    # the consumer's check, before it allocates anything: a decode instance with a bf16 KV
    # cache answers a 400 naming the field, and the producer's lease is released at once (not
    # left to expire)
    bf16 = ServerProcess("--model", cluster.model, *COMMON, "--kv-cache-dtype", "bfloat16",
                         "--kv-transfer-config", kv_config("kv_consumer"))
    try:
        resp = complete(bf16.url, prompt, kv_transfer_params=params)
        assert resp.status_code == 400, resp.text
        assert "kv_dtype 'float32' there, 'bfloat16' here" in resp.text, resp.text
        assert_clean(bf16)
    finally:
        bf16.close()
    expired = metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_expired_total")
    wait_until(lambda: metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_active") == 0,
               "lease released", timeout=LEASE_S - 0.5)
    assert metric_value(cluster.prefill.url, "kvflow:kv_transfer_leases_expired_total") == expired
    assert_clean(cluster.prefill, cluster.decode)


def test_64_concurrent_requests_with_failing_transfers(cluster, reference, default_tokenizer):
    cluster.set_faults(fail_every=3)  # every third pull breaks: those prompts are recomputed
    failed = metric_value(cluster.decode.url, "kvflow:kv_transfer_loads_failed_total")
    prompts = prompts_of([24] * 64, seed=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            texts = list(pool.map(lambda p: routed_tokens(cluster, p, default_tokenizer), prompts))
    finally:
        cluster.set_faults()
    assert texts == [ref_text(reference, p, default_tokenizer) for p in prompts]
    assert metric_value(cluster.decode.url, "kvflow:kv_transfer_loads_failed_total") >= failed + 15
    assert_clean(cluster.prefill, cluster.decode)


def test_tensor_parallel_instance_with_larger_blocks_lends_and_pulls(cluster, reference,
                                                                   default_tokenizer):
    """TP=2 on one side, TP=1 on the other, both ways: one kv_both instance over two ranks (each
    holding half the KV heads) is the prefill instance for the TP=1 decode instance, then the
    decode instance for the TP=1 prefill instance. Whole blocks travel; each side assembles or
    splits them by head range. Its blocks are twice the others' size: the consumer re-tiles
    what it receives token by token."""
    tp2 = ServerProcess("--model", cluster.model, *COMMON, "--quantization", "none",
                        "--block-size", str(2 * BLOCK), "--tensor-parallel-size", "2",
                        "--kv-transfer-config", kv_config("kv_both"))
    try:
        for prefill, decode, prompts, counter in (
                (tp2, cluster.decode, TP_PREFILL, "kvflow:kv_transfer_pulls_served_total"),
                (cluster.prefill, tp2, TP_DECODE, "kvflow:kv_transfer_loads_done_total")):
            before = metric_value(tp2.url, counter)
            proc, url = start_router("--prefill", prefill.url, "--decode", decode.url)
            try:
                for p in prompts:
                    resp = complete(url, p)
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["choices"][0]["text"] == ref_text(
                        reference, p, default_tokenizer), (len(p), prefill is tp2)
                    assert float(resp.headers["x-kvflow-prefill-ms"]) > 0  # the prefill hop
            finally:
                proc.terminate()
                proc.wait(10)
            assert metric_value(tp2.url, counter) == before + len(prompts), counter
        assert_clean(tp2, cluster.prefill, cluster.decode)
    finally:
        tp2.close()


def start_router(*args: str, ready: str = "/health") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", "router", "--port",
                             str(port), *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: proc.poll() is not None or _ok(url + ready), "router up")
    return proc, url


def test_router_balances_replicas_and_retries_a_dead_prefill(cluster, reference,
                                                              default_tokenizer):
    served = [metric_value(s.url, "kvflow:e2e_request_latency_seconds_count")
              for s in (cluster.prefill, cluster.decode)]
    proc, url = start_router("--replicas", cluster.prefill.url, cluster.decode.url)
    try:
        prompts = prompts_of([24] * 64, seed=2)[:12]
        for p in prompts:  # plain requests, each to one replica
            resp = complete(url, p)
            assert resp.json()["choices"][0]["text"] == ref_text(reference, p, default_tokenizer)
        after = [metric_value(s.url, "kvflow:e2e_request_latency_seconds_count")
                 for s in (cluster.prefill, cluster.decode)]
        assert all(a > b for a, b in zip(after, served)), (served, after)  # both took some
    finally:
        proc.terminate()
        proc.wait(10)
    dead = f"http://127.0.0.1:{free_port()}"
    # ready by /v1/models: a /health probe would mark the dead instance before any request
    proc, url = start_router("--prefill", dead, cluster.prefill.url, "--decode", cluster.decode.url,
                             ready="/v1/models")
    try:
        for p in prompts_of([30] * 20, seed=11):
            assert complete(url, p).status_code == 200
            text = httpx.get(url + "/metrics").text
            if "kvflow_router:prefill_retries_total 1.0" in text:
                break
        else:
            raise AssertionError("no request was retried away from the dead prefill instance")
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200 and not health.json()["backends"][dead]["healthy"]
    finally:
        proc.terminate()
        proc.wait(10)
    assert_clean(cluster.prefill, cluster.decode)


def test_killed_decode_instance_leaves_no_blocks_on_the_prefill_side(cluster, tiny_model):
    victim = ServerProcess("--model", tiny_model, *COMMON,
                           "--kv-transfer-config", kv_config("kv_consumer"))
    try:
        prompt = prompts_of([90], seed=8)[0]
        params = complete(cluster.prefill.url, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
        cluster.set_faults(delay_s=1.0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(complete, victim.url, prompt, 5, kv_transfer_params=params)
            wait_until(lambda: metric_value(victim.url, "kvflow:kv_transfer_loads_active") == 1,
                       "pull under way")
            os.kill(victim.engine_pid, signal.SIGKILL)
            victim.kill()
        cluster.set_faults()
        assert_clean(cluster.prefill)  # the lease expired: nobody beats for it any more
    finally:
        cluster.set_faults()
        victim.close()


def test_killed_prefill_instance_mid_transfer_is_recomputed(cluster, reference, default_tokenizer):
    """Last: it kills the cluster's prefill instance."""
    fresh = FRESH
    params = complete(cluster.prefill.url, fresh, max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    cluster.set_faults(delay_s=30.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, cluster.decode.url, fresh, kv_transfer_params=params)
        wait_until(lambda: metric_value(cluster.decode.url, "kvflow:kv_transfer_loads_active")
                   == 1, "pull under way")
        engine_pid = cluster.prefill.engine_pid
        cluster.prefill.kill()
        resp = fut.result(GUARD_S)
    # what the killed instance left in shared memory goes at the next start's sweep
    shm.sweep_orphans()
    assert not [f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"kvflow-kv-{engine_pid}-")]
    # recomputed on the decode side: the single engine's tokens
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == ref_text(reference, fresh, default_tokenizer)
    assert metric_value(cluster.decode.url, "kvflow:kv_transfer_loads_failed_total") >= 1
    assert_clean(cluster.decode)
