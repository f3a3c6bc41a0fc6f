"""The executor: what EngineCore hands each step to, so that the engine never knows how many
processes run the model. One interface, two implementations: UniProcExecutor (here) runs the
ModelRunner in the engine's own process; TPExecutor (kvflow.distributed.executor) runs it over
tensor_parallel_size ranks. EngineCore picks one at start-up."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.model.arch import LlamaArchConfig
from kvflow.worker.model_runner import ModelRunner, ModelRunnerOutput


class CompletedStep:
    """A step that has finished already."""

    __slots__ = ("_out",)

    def __init__(self, out: ModelRunnerOutput) -> None:
        self._out = out

    def result(self) -> ModelRunnerOutput:
        return self._out


class Executor(ABC):
    """Runs each step's forward and sampling. `runner` is this process's ModelRunner (the
    driver rank's under tensor parallelism)."""

    runner: ModelRunner

    @abstractmethod
    def execute(self, sched_out: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        """One step: the forward over the scheduled tokens, then the sampled token ids;
        `grammar` masks the constrained rows' logits (ModelRunner.execute)."""

    def execute_async(self, sched_out: SchedulerOutput, grammar=None):
        """Start one step; `.result()` of what it returns is `execute`'s output. Only a
        pipeline-parallel executor returns before the step is done (max_concurrent_batches)."""
        return CompletedStep(self.execute(sched_out, grammar))

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine may keep in flight (pipeline stages; 1 otherwise)."""
        return 1

    @abstractmethod
    def check_health(self) -> None:
        """Raise if no further step can run (e.g. a worker process died)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop what the executor started; safe to call twice."""

    def add_lora(self, lora_request) -> bool:
        """Read, check and register an adapter on every rank (False: this id is registered
        already with this path); ValueError naming the problem, nothing registered, if it
        cannot be served. The runner has LoRA slots (enable_lora)."""
        return self.runner.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter on every rank (False: it was not registered here)."""
        return self.runner.lora.remove(lora_int_id)

    def rank_kv_caches(self) -> list:
        """Each rank's KV cache (rank order, in this process's memory): what KV transfer
        reads and writes. One process holds one, all heads."""
        return [self.runner.kv_caches]

    def decode_step_rows(self) -> int:
        """The most rows a decode-only step runs in one C call (model/decode_graph.py); 0:
        none does (tensor parallelism, a GPU, a model the graph does not take)."""
        return 0

    # Time in collectives, for benchmarks; a single process has none.
    def reset_comm_stats(self) -> None:
        """Count collectives from here on (e.g. after warm-up)."""

    def comm_summary(self) -> dict:
        """Collectives per step as numbers; empty where there are none."""
        return {}


class UniProcExecutor(Executor):
    """The whole model in this process."""

    def __init__(self, model: torch.nn.Module, arch: LlamaArchConfig, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, eos_token_id: int | list[int] | None,
                 device: torch.device | str = "cpu", graphs=None, max_model_len: int = 0,
                 num_state_slots: int = 0, encoder_cache_size: int = 0) -> None:
        self.runner = ModelRunner(model, arch, num_blocks, block_size, kv_dtype, eos_token_id,
                                  device=device, graphs=graphs, max_model_len=max_model_len,
                                  num_state_slots=num_state_slots,
                                  encoder_cache_size=encoder_cache_size)

    def execute(self, sched_out: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        return self.runner.execute(sched_out, grammar)

    def decode_step_rows(self) -> int:
        rows = getattr(self.runner.model, "decode_step_rows", None)
        return rows() if rows is not None and self.runner.device.type == "cpu" else 0

    def check_health(self) -> None:
        pass  # nothing outside this process to fail

    def shutdown(self) -> None:
        pass  # the KV cache and the model go with the executor
