"""Pipeline parallelism and the Ray executor backend: greedy outputs equal one process's with
the decoder layers split into stages (on kvflow's own processes and on Ray actors, with and
without tensor parallelism) while chunked prefill, preemption and two steps in flight happen;
TP=2 on Ray equals TP=1; a Ray worker that dies stops the engine with a clear error and leaves
no actor or placement group behind. One local Ray cluster (loopback only) serves the module."""
from __future__ import annotations

import os
import random
import signal
import time

import httpx

import psutil
import pytest

from conftest_model_helpers import _save_random
from server_helpers import ServerProcess

from kvflow.config import CacheConfig, ParallelConfig, SchedulerConfig
from kvflow.core.scheduler import Scheduler
from kvflow.distributed.executor import WorkerFailedError
from kvflow.distributed.pipeline import check_pp_size, stage_layers
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

# Llama-shaped, 8 heads / 4 KV heads, 4 layers: two stages of two layers, and TP=2 within each
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=1001, max_position_embeddings=1024)
ENGINE = dict(dtype="float32", max_model_len=512, num_threads=1, quantization="none")
# 32 tokens a step cuts the prompts into chunks (several steps' batches in the pipeline at
# once); 14 blocks of 16 cannot hold four requests growing to 108 tokens, so some are preempted
SQUEEZED = dict(max_num_batched_tokens=32, num_blocks=14, block_size=16, max_num_seqs=8)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


PROMPTS = random_prompts([60, 60, 60, 60], seed=1)


# -- bookkeeping, no model ---------------------------------------------------------------------
def test_layers_split_evenly_the_first_stages_taking_the_remainder():
    assert [stage_layers(30, 2, s) for s in range(2)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(10, 3, s) for s in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]


def test_more_stages_than_layers_is_refused():
    from kvflow.model.arch import LlamaArchConfig
    arch = LlamaArchConfig(**TINY, architecture="LlamaForCausalLM", head_dim=16, rms_norm_eps=1e-6,
                           rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                           attention_bias=False, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 is more than the model's 4"):
        check_pp_size(arch, 5)


def test_parallel_options_are_checked():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        ParallelConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="placement_group_strategy must be one of PACK"):
        ParallelConfig(placement_group_strategy="pack")
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_a_request_in_flight_is_neither_scheduled_again_nor_preempted():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                      CacheConfig(block_size=4, num_blocks=4))
    sched.max_concurrent_batches = 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, b = Request("a", [1] * 8, params), Request("b", [2] * 8, params)
    sched.add_request(a)
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["a"] and sched.in_flight == {"a"}
    sched.add_request(b)
    second = sched.schedule()  # "a" is still in the pipeline: only "b" runs
    assert list(second.num_scheduled_tokens) == ["b"]
    assert sched.in_flight == {"a", "b"}
    sched.update_from_output(first, {"a": [7]})
    assert sched.in_flight == {"b"}
    # "a" needs a third block and none is free; "b" (in flight) is not the victim: "a" is
    third = sched.schedule()
    assert third.preempted_req_ids == ["a"] and third.num_scheduled_tokens == {}
    assert [r.request_id for r in sched.running] == ["b"]
    sched.update_from_output(second, {"b": [7]})
    assert sched.in_flight == set()
    fourth = sched.schedule()  # "b" is back from the pipeline: it decodes
    assert fourth.num_scheduled_tokens == {"b": 1}


# -- equal outputs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("pp") / "tiny-4-layers")
    config = LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    default_tokenizer.save_pretrained(path)
    return path


def run(model: str, prompts=PROMPTS, params=PARAMS, **kwargs) -> tuple[list[list[int]], dict]:
    """Token ids of each prompt from a fresh engine (shut down afterwards), and what happened:
    the most steps in flight at once, preemptions, the executor's per-step numbers."""
    from kvflow.entrypoints.llm import LLM

    llm = LLM(model, **ENGINE, **kwargs)
    core = llm.engine.core
    seen = {"in_flight": 0, "preempted": 0}
    schedule = core.scheduler.schedule

    def watched():
        out = schedule()
        seen["in_flight"] = max(seen["in_flight"], len(core._batch_queue) + (not out.is_empty))
        seen["preempted"] += len(out.preempted_req_ids)
        return out

    core.scheduler.schedule = watched
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        seen["comm"] = core.executor.comm_summary()
        seen["executor"] = core.executor
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], seen


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    out, seen = run(tiny_model, **SQUEEZED)
    assert seen["preempted"], "the squeezed workload preempts nobody"
    assert len({tuple(o) for o in out}) == len(out)
    return out


def worker_pids(executor) -> list[int]:
    return list(executor.supervisor.pids)


@pytest.mark.slow
def test_pp2_equals_tp1_with_two_steps_in_flight(tiny_model, reference):
    out, seen = run(tiny_model, pipeline_parallel_size=2, **SQUEEZED)
    assert out == reference
    assert seen["in_flight"] == 2, "the stages never overlapped"
    assert seen["preempted"]
    # each stage boundary carries [2, tokens, hidden] fp32 per step: at most 32 tokens here
    per_step = seen["comm"]["pp_hidden_bytes_per_step"]
    assert 0 < per_step <= 2 * 32 * TINY["hidden_size"] * 4
    pids = worker_pids(seen["executor"])
    assert len(pids) == 1 and not any(psutil.pid_exists(p) for p in pids)


@pytest.mark.slow
def test_tp2_by_pp2_equals_tp1(tiny_model, reference):
    out, seen = run(tiny_model, tensor_parallel_size=2, pipeline_parallel_size=2, **SQUEEZED)
    assert out == reference
    assert seen["in_flight"] == 2
    assert len(worker_pids(seen["executor"])) == 3
    # each stage's two ranks all-reduce through their own shared-memory segment
    assert "all_reduce_shm" in seen["comm"]["comm_ms_per_step_by_op"]


def constrained_run(model: str, **kwargs) -> tuple[list[str], dict]:
    """Texts of a batch mixing constrained requests (a regex, a choice, a JSON schema) with free
    ones, under the squeezed budget, and what happened."""
    from kvflow.entrypoints.llm import LLM

    def constrained(**so):
        return SamplingParams(max_tokens=24, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(**so))

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [constrained(regex="[a-z]{3,12}"), PARAMS, constrained(choice=["yes", "no", "maybe"]),
              PARAMS, constrained(json=schema)]
    prompts = PROMPTS + random_prompts([40], seed=2)
    llm = LLM(model, **ENGINE, **SQUEEZED, **kwargs)
    core = llm.engine.core
    seen = {"in_flight": 0}
    schedule = core.scheduler.schedule

    def watched():
        out = schedule()
        seen["in_flight"] = max(seen["in_flight"], len(core._batch_queue) + (not out.is_empty))
        return out

    core.scheduler.schedule = watched
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].text for o in outs], seen


@pytest.fixture(scope="module")
def tiny_full_vocab(tmp_path_factory, default_tokenizer) -> str:
    """TINY's layers over the default tokenizer's whole vocabulary, which grammars compile for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("pp") / "tiny-full-vocab")
    config = LlamaConfig(**{**TINY, "hidden_size": 64, "vocab_size": len(default_tokenizer)},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_structured_outputs_under_pp2_equal_one_process(tiny_full_vocab):
    import re

    tiny_model = tiny_full_vocab
    reference, _ = constrained_run(tiny_model)
    assert re.fullmatch("[a-z]{3,12}", reference[0]) and reference[2] in ("yes", "no", "maybe")
    assert reference[4].startswith("{")  # a random model's integer may outrun 24 tokens
    out, seen = constrained_run(tiny_model, pipeline_parallel_size=2)
    assert out == reference
    assert seen["in_flight"] == 2  # the free requests' steps overlapped in the pipeline


# -- on Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on the loopback interface, for this module only."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


def alive_actors(ray) -> list[dict]:
    # the GCS's actor table (ray.util.state.list_actors needs the dashboard, off here)
    from ray._private import state
    return [a for a in state.actors().values() if a["State"] != "DEAD"]


@pytest.mark.slow
def test_tp2_on_ray_equals_tp1(ray_cluster, tiny_model, reference):
    out, seen = run(tiny_model, tensor_parallel_size=2, distributed_executor_backend="ray",
                    **SQUEEZED)
    assert out == reference
    # the actor shared this machine with the driver: all-reduces through shared memory
    assert "all_reduce_shm" in seen["comm"]["comm_ms_per_step_by_op"]
    assert alive_actors(ray_cluster) == []


@pytest.mark.slow
def test_pp2_on_ray_equals_tp1(ray_cluster, tiny_model, reference):
    out, seen = run(tiny_model, pipeline_parallel_size=2, distributed_executor_backend="ray",
                    placement_group_strategy="SPREAD", **SQUEEZED)
    assert out == reference
    assert seen["in_flight"] == 2
    assert alive_actors(ray_cluster) == []
    assert all(pg["state"] == "REMOVED" for pg in ray_cluster.util.placement_group_table().values())


@pytest.mark.slow
def test_a_dead_ray_worker_stops_the_engine_and_leaves_nothing_behind(ray_cluster, tiny_model):
    from kvflow.entrypoints.llm import LLM

    llm = LLM(tiny_model, **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray",
              num_blocks=64)
    executor = llm.engine.core.executor
    try:
        (pid,) = executor.supervisor.pids
        assert len(alive_actors(ray_cluster)) == 1
        assert len(llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 48
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match=rf"worker rank 1 \(Ray actor, pid {pid} .*\) "
                                                     r"died .*; the engine has stopped"):
            llm.generate([PROMPTS[1]], PARAMS, use_tqdm=False)
        with pytest.raises(WorkerFailedError):  # every later step says so too
            llm.generate([PROMPTS[1]], PARAMS, use_tqdm=False)
        assert alive_actors(ray_cluster) == []
        pg = executor.supervisor.pg.id.hex()
        assert ray_cluster.util.placement_group_table()[pg]["state"] == "REMOVED"
    finally:
        llm.engine.shutdown()
    assert not psutil.pid_exists(pid)


@pytest.mark.slow
def test_kvflow_serve_on_ray_answers_503_when_a_worker_dies(ray_cluster, tiny_model):
    address = ray_cluster.get_runtime_context().gcs_address  # the module's cluster
    srv = ServerProcess(tiny_model, "-pp", "2", "--distributed-executor-backend", "ray",
                        "--ray-address", address, "--dtype", "float32", "--max-model-len", "512",
                        "--num-blocks", "64")
    try:
        (actor,) = alive_actors(ray_cluster)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            resp = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            os.kill(actor["Pid"], signal.SIGKILL)  # no request in flight: the idle engine notices
            deadline = time.monotonic() + 60  # a hang guard, not a speed target
            codes = []
            while not codes or codes[-1] == 200:
                assert time.monotonic() < deadline, "/health still OK 60 s after a worker died"
                try:
                    codes.append(http.get("/health", timeout=5).status_code)
                except httpx.TransportError:  # the server has already gone
                    codes.append(None)
                time.sleep(0.1)
        assert 503 in codes  # before the server goes, its /health says the engine is down
        assert srv.proc.wait(60) != 0
        assert "WorkerFailedError: tensor-parallel worker rank 1 (Ray actor" in srv.output()
        assert alive_actors(ray_cluster) == []
        assert all(pg["state"] == "REMOVED"
                   for pg in ray_cluster.util.placement_group_table().values())
        assert srv.leftover_children() == []
    finally:
        srv.close()
