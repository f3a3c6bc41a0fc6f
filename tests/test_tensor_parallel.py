"""Tensor parallelism: with the model split over N processes, greedy outputs equal a
single process's, through `LLM` and `kvflow serve`; chunked prefill and preemption still happen
(the step trace shows them); a worker that dies stops the engine with a clear error and leaves no
process behind; two "nodes" meet over tcp:// on loopback."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import NEW_TOKENS
from conftest_model_helpers import _save_random
from server_helpers import REPO, ServerProcess, free_port

from kvflow.distributed.executor import WorkerFailedError
from kvflow.entrypoints.llm import LLM
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# Llama-shaped, 8 heads / 4 KV heads; a vocab of 1001 rows leaves rank 1's vocab shard padded.
TINY_8H_4KV = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1001,
                   max_position_embeddings=1024)
# float weights: tensor parallelism serves no quantized GEMM, so TP=1 must not use one either
ENGINE = dict(dtype="float32", max_model_len=512, num_threads=1, quantization="none")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def save_tiny(path: str, tokenizer, **overrides) -> str:
    """A random Llama (TINY_8H_4KV unless overridden), untied LM head, the default tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_8H_4KV, **overrides}, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_tokenizer) -> str:
    return save_tiny(str(tmp_path_factory.mktemp("tp") / "tiny-8h-4kv"), default_tokenizer)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


TINY_PROMPTS = random_prompts([5, 17, 40, 90, 130])


def generate(model: str | None, prompts, params: SamplingParams, **kwargs) -> list[list[int]]:
    """Token ids of each prompt from a fresh engine, which is shut down afterwards."""
    llm = LLM(model, **ENGINE, **kwargs)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def gone(pids: list[int]) -> bool:
    """No process with these pids (they were ours and are reaped)."""
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model) -> list[list[int]]:
    ref = generate(tiny_model, TINY_PROMPTS, GREEDY)
    assert len({tuple(o) for o in ref}) == len(ref)  # the prompts lead to different outputs
    return ref


# -- equal outputs ---------------------------------------------------------------------------
def test_tp2_greedy_equals_tp1_with_8_heads_and_4_kv_heads(tiny_model, tiny_reference):
    llm = LLM(tiny_model, **ENGINE, tensor_parallel_size=2)
    try:
        executor = llm.engine.core.executor
        layer = executor.model.layers[0]
        d = TINY_8H_4KV["hidden_size"] // TINY_8H_4KV["num_attention_heads"]
        # the driver really holds a shard: 4 of 8 heads, 2 of 4 KV heads, half the MLP and vocab
        assert tuple(layer.qkv_proj.shape) == ((4 + 2 + 2) * d, 128)
        assert tuple(layer.down_proj.shape) == (128, 128)
        assert tuple(executor.model.embed_tokens.shape) == (501, 128)
        k0 = executor.runner.kv_caches[0][0]
        assert (k0.shape[1], k0.shape[3]) == (2, d)  # [blocks, kv heads, block size, head dim]
        workers = executor.supervisor.pids
        assert len(workers) == 1 and psutil.Process(workers[0]).is_running()
        got = [list(o.outputs[0].token_ids)
               for o in llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == tiny_reference
    assert gone(workers), "a worker outlived shutdown()"


def test_tp_size_that_cannot_split_the_heads_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the number of "
                                         r"attention heads \(8\)"):
        LLM(tiny_model, **ENGINE, tensor_parallel_size=3)


SMOL_GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SERVED = [0, 2, 7]  # of the shared prompts: a short one, Japanese, the long paragraph


def test_tp4_with_fewer_kv_heads_than_ranks_equals_tp1(tmp_path, default_tokenizer):
    # 8 heads / 2 KV heads on 4 ranks: each KV head is held by the two ranks that read it
    path = save_tiny(str(tmp_path / "tiny-8h-2kv"), default_tokenizer, num_key_value_heads=2)
    prompts = TINY_PROMPTS[:3]
    assert generate(path, prompts, GREEDY, tensor_parallel_size=4) == generate(path, prompts, GREEDY)


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head(tiny_model):
    from dataclasses import replace

    from kvflow.model.arch import load_arch_config
    from kvflow.model.sharding import shard_layout

    arch = replace(load_arch_config(tiny_model), num_key_value_heads=2)  # 8 heads / 2 KV heads
    layouts = [shard_layout(arch, r, 4) for r in range(4)]
    assert [lay.q_head_start for lay in layouts] == [0, 2, 4, 6]
    # query heads 0-3 read KV head 0, heads 4-7 KV head 1
    assert [(lay.kv_head_start, lay.num_kv_heads) for lay in layouts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [(lay.vocab_start, lay.vocab_end) for lay in layouts] == [(0, 251), (251, 502),
                                                                       (502, 753), (753, 1001)]


@pytest.fixture(scope="module")
def smol_reference(prompt_ids):
    """TP=1 outputs of the default model on the shared prompts: all at once, and one by one
    (the batch a server forms from requests as they arrive is the single request's own)."""
    llm = LLM(None, **ENGINE)
    try:
        together = llm.generate(prompt_ids, SMOL_GREEDY, use_tqdm=False)
        alone = [llm.generate([prompt_ids[i]], SMOL_GREEDY, use_tqdm=False)[0] for i in SERVED]
    finally:
        llm.engine.shutdown()
    return [o.outputs[0] for o in together], [o.outputs[0] for o in alone]


def test_tp3_default_model_equals_tp1(prompt_ids, smol_reference):
    # SmolLM2-135M: 9 heads / 3 KV heads, one KV head per rank
    got = generate(None, prompt_ids, SMOL_GREEDY, tensor_parallel_size=3)
    assert got == [list(c.token_ids) for c in smol_reference[0]]


def test_kvflow_serve_tp3_equals_tp1(prompt_ids, smol_reference):
    srv = ServerProcess("--tensor-parallel-size", "3", "--dtype", "float32", "--max-model-len",
                        "512", "--num-blocks", "256", "--quantization", "none")
    try:
        workers = [p for p in srv.children if "kvflow.distributed.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2
        texts = []
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            for i in SERVED:  # one at a time: each request's batch is its own, as in the reference
                resp = http.post("/v1/completions", json={
                    "prompt": prompt_ids[i], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                texts.append(resp.json()["choices"][0]["text"])
        assert texts == [c.text for c in smol_reference[1]]
        assert srv.terminate() == 0
        assert srv.leftover_children() == []
    finally:
        srv.close()


# -- chunked prefill and preemption under TP -------------------------------------------------
# 32 tokens a step cuts every prompt into chunks; 14 blocks of 16 cannot hold four requests
# growing to 124 tokens (8 blocks each), so some are preempted and recomputed.
SQUEEZED = dict(max_num_batched_tokens=32, num_blocks=14, block_size=16, max_num_seqs=8)
SQUEEZED_PROMPTS = random_prompts([60, 60, 60, 60], seed=1)
SQUEEZED_PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def squeezed_runs(tiny_model, tmp_path_factory):
    """(outputs, trace) of the squeezed workload at TP=1 and at TP=2."""
    runs = {}
    for tp in (1, 2):
        trace = str(tmp_path_factory.mktemp("trace") / f"tp{tp}.jsonl")
        out = generate(tiny_model, SQUEEZED_PROMPTS, SQUEEZED_PARAMS, trace=trace,
                       tensor_parallel_size=tp, **SQUEEZED)
        runs[tp] = (out, read_trace(trace))
    return runs


def schedule_of(trace: list[dict]) -> list[list[tuple]]:
    return [[(r["id"], r["phase"], r["tokens"], r["num_computed_tokens"]) for r in rec["requests"]]
            for rec in trace]


def test_chunked_prefill_under_tp(squeezed_runs):
    out, trace = squeezed_runs[2]
    assert max(rec["num_scheduled_tokens"] for rec in trace) <= 32
    later_chunks = [r for rec in trace for r in rec["requests"]
                    if r["phase"] == "prefill" and r["num_computed_tokens"] > 0]
    assert later_chunks, "no prompt was split into chunks"
    # a step that mixes decodes with a prompt chunk
    assert any({r["phase"] for r in rec["requests"]} == {"prefill", "decode"} for rec in trace)
    assert out == squeezed_runs[1][0]


def test_preemption_under_tp(squeezed_runs):
    out, trace = squeezed_runs[2]
    preempted = [rid for rec in trace for rid in rec["preempted"]]
    assert preempted, "no request was preempted"
    # a preempted request comes back later and its tokens are computed again (a prefill)
    first = preempted[0]
    step = next(i for i, rec in enumerate(trace) if first in rec["preempted"])
    assert any(r["id"] == first and r["phase"] == "prefill"
               for rec in trace[step + 1:] for r in rec["requests"])
    assert all(len(o) == SQUEEZED_PARAMS.max_tokens for o in out)
    assert out == squeezed_runs[1][0]
    # the single scheduler made the same decisions at every step
    assert schedule_of(trace) == schedule_of(squeezed_runs[1][1])


# -- failure ---------------------------------------------------------------------------------
def test_killing_a_worker_mid_run_stops_the_engine_with_a_clear_error(tiny_model):
    llm = LLM(tiny_model, **ENGINE, tensor_parallel_size=2)
    executor = llm.engine.core.executor
    (pid,) = executor.supervisor.pids
    start_steps = executor.num_steps
    killed_at: list[float] = []

    def kill_once_running() -> None:
        while executor.num_steps < start_steps + 10:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_once_running, daemon=True)
    killer.start()
    params = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    try:
        with pytest.raises(WorkerFailedError, match=rf"tensor-parallel worker rank 1 \(pid {pid}\) "
                                                     r"was killed by SIGKILL; the engine has stopped"):
            llm.generate(random_prompts([8, 8, 8]), params, use_tqdm=False)
        with pytest.raises(WorkerFailedError):  # every later step says so too
            llm.generate(random_prompts([8]), GREEDY, use_tqdm=False)
    finally:
        killer.join(10)
        llm.engine.shutdown()
    assert gone([pid])
    assert not [p for p in psutil.Process().children(recursive=True)
                if "kvflow.distributed.worker" in " ".join(p.cmdline())]


def test_kvflow_serve_exits_nonzero_when_a_worker_dies(tiny_model):
    srv = ServerProcess(tiny_model, "-tp", "2", "--dtype", "float32", "--max-model-len", "512",
                        "--num-blocks", "64")
    try:
        (worker,) = [p for p in srv.children if "kvflow.distributed.worker" in " ".join(p.cmdline())]
        body = {"prompt": random_prompts([8])[0], "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = (line for line in resp.iter_lines() if line)
                for _ in range(5):
                    assert next(lines).startswith("data: ")
                worker.kill()
                rest = [line for line in lines if line.startswith("data: ")]  # ends, or times out
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        assert srv.proc.wait(30) != 0
        assert (f"WorkerFailedError: tensor-parallel worker rank 1 (pid {worker.pid}) was killed "
                "by SIGKILL; the engine has stopped") in srv.output()
        assert srv.leftover_children() == []
    finally:
        srv.close()


def test_kvflow_serve_tp2_equals_tp1_then_notices_a_dead_worker_when_idle(tiny_model):
    reference = LLM(tiny_model, **ENGINE)
    try:
        want = [reference.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].text
                for p in TINY_PROMPTS]  # one at a time, as the server gets them
    finally:
        reference.engine.shutdown()
    srv = ServerProcess(tiny_model, "-tp", "2", "--dtype", "float32", "--max-model-len", "512",
                        "--num-blocks", "64")
    try:
        (worker,) = [p for p in srv.children if "kvflow.distributed.worker" in " ".join(p.cmdline())]
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for prompt, text in zip(TINY_PROMPTS, want):
                resp = http.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                    "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == text
        worker.kill()  # no request in flight: the idle engine core checks its workers
        deadline = time.monotonic() + 60  # a hang guard, not a speed target
        def healthy() -> bool:
            try:
                return httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:  # the server has already gone
                return False

        while healthy():
            assert time.monotonic() < deadline, "/health still OK 60 s after a worker died"
            time.sleep(0.1)
        assert srv.proc.wait(30) != 0
        assert "WorkerFailedError: tensor-parallel worker rank 1" in srv.output()
        assert srv.leftover_children() == []
    finally:
        srv.close()


# -- several nodes ---------------------------------------------------------------------------
def test_two_nodes_on_loopback_equal_tp1(tiny_model, tiny_reference, tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "node1.log", "w+")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--distributed-init-method", init],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, KVFLOW_NUM_THREADS="1"))
    try:
        got = generate(tiny_model, TINY_PROMPTS, GREEDY, tensor_parallel_size=2, nnodes=2,
                       node_rank=0, distributed_init_method=init)
        code = node1.wait(30)
        log.seek(0)
        output = log.read()
        assert code == 0, output
        assert "the engine shut the group down; node 1 done" in output
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
        log.close()
    assert got == tiny_reference


def test_embeddings_and_prompt_logprobs_under_tp2_equal_tp1(tiny_model):
    """The driver pools and scores; every rank joins each 128-row slice's vocab gather (the
    130-token prompt takes two)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    runs = []
    for tp in (1, 2):
        llm = LLM(tiny_model, **ENGINE, tensor_parallel_size=tp,
                  pooler_config={"pooling_type": "MEAN"})
        try:
            embs = [o.outputs.embedding for o in llm.embed(TINY_PROMPTS, use_tqdm=False)]
            scored = [o.prompt_logprobs for o in llm.generate(TINY_PROMPTS, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
        runs.append((embs, scored))
    (embs1, scored1), (embs2, scored2) = runs
    for a, b in zip(embs1, embs2):
        assert sum(x * y for x, y in zip(a, b)) > 0.99999
    for ids, a, b in zip(TINY_PROMPTS, scored1, scored2):
        assert len(a) == len(b) == len(ids) and a[0] is None and b[0] is None
        for p in range(1, len(ids)):
            assert abs(a[p][ids[p]].logprob - b[p][ids[p]].logprob) < 1e-4
