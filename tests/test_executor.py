"""EngineCore hands every step to one executor: UniProcExecutor runs the ModelRunner in the
engine's process, TPExecutor runs it over tensor-parallel ranks; both are an Executor."""
from __future__ import annotations

import pytest
import torch

from conftest_model_helpers import save_tiny_llama3
from core_helpers import make_scheduler
from kvflow.config import CacheConfig, EngineConfig, ModelConfig
from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.distributed.executor import TPExecutor
from kvflow.engine.core import EngineCore
from kvflow.engine.protocol import EngineCoreRequest
from kvflow.model.executor import Executor, UniProcExecutor
from kvflow.model.loader import load_model
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_llama3(str(tmp_path_factory.mktemp("tiny") / "llama3"))


def test_both_executors_implement_the_interface():
    assert issubclass(UniProcExecutor, Executor) and issubclass(TPExecutor, Executor)
    with pytest.raises(TypeError):
        Executor()  # execute, check_health and shutdown are abstract


def test_single_process_executor_runs_a_step(tiny_model):
    model, arch = load_model(tiny_model, torch.float32)
    executor = UniProcExecutor(model, arch, num_blocks=16, block_size=4, kv_dtype=torch.float32,
                               eos_token_id=arch.eos_token_id)
    sched = make_scheduler(num_blocks=16, block_size=4, budget=32, max_model_len=64)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    sched.add_request(Request("a", [11, 12, 13, 14, 15, 16], greedy))
    sched.add_request(Request("b", [21, 22, 23], greedy))

    out = sched.schedule()
    assert isinstance(out, SchedulerOutput)
    result = executor.execute(out)
    # both prompts fit the budget: each request samples its first token in this step
    assert sorted(result.sampled) == ["a", "b"]
    assert all(len(ids) == 1 and 0 <= ids[0] < arch.vocab_size for ids in result.sampled.values())
    sched.update_from_output(out, result.sampled)
    second = executor.execute(sched.schedule())  # a decode step reads the KV written above
    assert sorted(second.sampled) == ["a", "b"]

    executor.check_health()
    assert executor.comm_summary() == {}  # no collectives in one process
    executor.shutdown()
    executor.shutdown()  # twice is harmless


def test_engine_core_holds_one_executor(tiny_model):
    config = EngineConfig(model_config=ModelConfig(model=tiny_model, dtype="float32"),
                          cache_config=CacheConfig(block_size=4, num_blocks=32), warmup=False)
    core = EngineCore(config)
    try:
        assert isinstance(core.executor, UniProcExecutor)
        assert not hasattr(core, "runner")  # no second name for the same thing
        calls = []
        execute = core.executor.execute
        core.executor.execute = lambda sched_out: calls.append(sched_out) or execute(sched_out)

        core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0)))
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step().outputs
        assert sum(len(o.new_token_ids) for o in outputs) == 2
        assert outputs[-1].finish_reason == "length"
        assert len(calls) == 2  # every step went through the executor
        core.check_health()
    finally:
        core.shutdown()
