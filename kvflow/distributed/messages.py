"""What the driver sends the other tensor-parallel ranks, as typed msgpack (msgspec), never
pickle: the rendezvous store and the step broadcast travel over TCP, and a frame from whoever
reaches those ports decodes into these types or fails; it cannot run code.

    store "init"       WorkerInit      what to load (once)
    step broadcast     StepMessage     the step's SchedulerOutput and last step's sampled tokens
                                       (and, under pipeline parallelism, its grammar masks for
                                       the last stage, which samples)
                       LoRAUpdate      adapters to register or drop before the next step
                       nil             stop
    (pipeline parallel: the same step messages go to each rank point to point, and the last
    stage answers each with a StepResult)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
import numpy as np

from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.lora_request import LoRARequest
from kvflow.outputs import TokenLogprobs


@dataclass
class WorkerInit:
    """What every rank must agree on, published by the driver in the store."""

    model_path: str
    dtype: str  # float32 | bfloat16
    kv_dtype: str  # the KV cache's: float32 | bfloat16 | int8 | float8_e4m3fn
    num_blocks: int
    block_size: int
    num_threads: int
    eos_token_id: int | list[int] | None
    shm_path: str | None = None  # the shared-memory all-reduce segment (single machine)
    shm_slot_bytes: int = 0
    device: str = "cpu"  # cpu, or cuda: each rank on GPU `rank % device_count`, NCCL collectives
    # with KV transfer: rank r (r >= 1) keeps its KV cache in kv_shm_paths[r - 1] (shared_kv.py)
    kv_shm_paths: list[str] | None = None
    tp_size: int = 0  # ranks per pipeline stage (0: all of them, one stage)
    pp_size: int = 1  # pipeline stages
    driver_pid: int | None = None  # for a worker that is not the driver's child (a Ray actor)
    # pipeline parallel on one machine: stage s's tp ranks all-reduce in stage_shm_paths[s]
    stage_shm_paths: list[str] | None = None
    max_model_len: int = 0  # the longest sequence admitted (0: the model's context)
    encoder_cache_size: int = 0  # image tokens of encoder outputs kept across steps
    # the model's arch config as the driver resolved it (LlamaArchConfig.to_dict): no rank
    # reads config.json or the GGUF header again
    arch: dict | None = None
    max_loras: int = 0  # enable_lora: adapter slots on every rank (0: off)
    max_lora_rank: int = 0
    # how the weights are served, as the engine resolved it: gguf (a GGUF file's shard as
    # stored) or none (float weights)
    quantization: str = "none"


class StepMasks(msgspec.Struct, array_like=True):
    """A step's grammar masks as the sampling rank reads them (the runner's `grammar`:
    `req_ids`, `num_rows`, `bitmask`), filled on the driver, where the grammars advance."""

    req_ids: list[str]
    num_rows: list[int]
    words: int  # int32 words per row: ceil(vocab / 32)
    mask_bytes: bytes

    @classmethod
    def of(cls, grammar) -> "StepMasks":
        """The driver's GrammarBitmask (waits for its fill)."""
        bitmask = grammar.bitmask
        return cls(list(grammar.req_ids), list(grammar.num_rows), int(bitmask.shape[1]),
                   np.ascontiguousarray(bitmask, dtype=np.int32).tobytes())

    @property
    def bitmask(self) -> np.ndarray:
        """int32 [sum(num_rows), words]; a frame whose sizes disagree is a BadMessageError."""
        rows = sum(self.num_rows)
        if len(self.req_ids) != len(self.num_rows) or len(self.mask_bytes) != rows * self.words * 4:
            raise BadMessageError("the step's grammar masks do not match their rows")
        return np.frombuffer(self.mask_bytes, dtype=np.int32).reshape(rows, self.words)


class StepMessage(msgspec.Struct, array_like=True, tag=True):
    sched_out: SchedulerOutput
    sampled: dict[str, list[int]]  # what the driver sampled in the previous step
    grammar: StepMasks | None = None  # pipeline parallelism: for the last stage's sampler


class LoRAUpdate(msgspec.Struct, array_like=True, tag=True):
    """Adapters every rank registers (`add`, read from their folders) or drops (`remove`, by
    id) between two steps: in the step stream, so that every rank sees the same adapters at
    every step and assigns them the same slots. `seq` > 0: each rank answers in the store
    under `lora/SEQ/RANK` ("" or why it could not load one)."""

    seq: int
    add: list[LoRARequest]
    remove: list[int]


class StepResult(msgspec.Struct, array_like=True):
    """What the last pipeline stage sampled in one step, for the driver."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]


_encoder = msgspec.msgpack.Encoder()
_result_decoder = msgspec.msgpack.Decoder(StepResult)
_step_decoder = msgspec.msgpack.Decoder(StepMessage | LoRAUpdate | None)
_init_decoder = msgspec.msgpack.Decoder(WorkerInit)


class BadMessageError(RuntimeError):
    """A frame that is not one of the driver's messages (a bug, or someone else on the port)."""


# What the scheduler recorded about its decisions (for the trace and stats): the workers' runners
# never read it, and block_checks grows with the waiting queue, so it stays on the driver.
_DECISIONS_CLEARED = dict(is_prefill={}, preempted_for={}, block_checks={}, skipped_req_ids=[],
                          prefix_cache_bypassed={},
                          waiting_for_grammar_ids=[], admission_stop=None, grammar_errors={},
                          waiting_for_lora_ids=[], kv_loads=[], waiting_for_remote_kv_ids=[],
                          kv_load_errors={})


def encode_step(sched_out: SchedulerOutput | None, sampled: dict[str, list[int]],
                grammar: StepMasks | None = None) -> bytes:
    """One step's broadcast (what the runner reads); `sched_out=None` tells the workers to stop."""
    if sched_out is None:
        return _encoder.encode(None)
    return _encoder.encode(StepMessage(replace(sched_out, **_DECISIONS_CLEARED), sampled, grammar))


def encode_lora_update(update: LoRAUpdate) -> bytes:
    return _encoder.encode(update)


def decode_step(data: bytes) -> StepMessage | LoRAUpdate | None:
    try:
        return _step_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise BadMessageError(f"the step broadcast is not a kvflow step: {e}") from None


def encode_init(init: WorkerInit) -> bytes:
    return _encoder.encode(init)


def decode_init(data: bytes) -> WorkerInit:
    try:
        return _init_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise BadMessageError(f"the store's init entry is not a WorkerInit: {e}") from None


def encode_result(sampled: dict[str, list[int]], logprobs: dict[str, list[TokenLogprobs]]) -> bytes:
    return _encoder.encode(StepResult(sampled, logprobs))


def decode_result(data: bytes) -> StepResult:
    try:
        return _result_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise BadMessageError(f"a pipeline result is not a kvflow StepResult: {e}") from None
