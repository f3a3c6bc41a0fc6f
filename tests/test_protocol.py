"""The wire protocol between the frontend and the engine-core process: every message type in
kvflow.engine.protocol comes back equal through msgpack, and the frames tell messages apart."""
from __future__ import annotations

import inspect

import msgspec
import pytest

from kvflow.engine import protocol
from kvflow.engine.protocol import (BLOCK_LEGEND, CoreMessage, EngineCoreOutput, EngineCoreOutputs,
                                    EngineCoreReady, EngineCoreRequest, EngineCoreRequestType,
                                    EngineSnapshot, KVTransferStats, LoRAResult,
                                    PromptLogprobsChunk, RequestView, SchedulerStats, StepTokens,
                                    TokenLogprobs, UtilityCall)
from kvflow.pooling_params import PoolingParams
from kvflow.kv_transfer.params import KVTransferParams
from kvflow.lora_request import LoRARequest
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

LOGPROBS = TokenLogprobs(token_ids=[5, 9, 2], logprobs=[-0.1, -2.5, -3.0], sampled_rank=1)
STATS = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_free_blocks=30,
                       num_total_blocks=40, num_preemptions=1, num_prompt_tokens=12,
                       num_generation_tokens=2, step_time=0.012, prefix_cache_queries=64,
                       prefix_cache_hits=16)
KV_STATS = KVTransferStats(leases_active=1, loads_active=2, leases_granted=5, leases_released=3,
                           leases_expired=1, pulls_served=4, bytes_sent=1 << 20, blocks_sent=9,
                           loads_done=6, loads_failed=1, bytes_received=2 << 20,
                           blocks_received=12, load_seconds=0.25, late_frames=1)
KV_PARAMS = KVTransferParams(do_remote_prefill=True, remote_engine_id="e1", remote_host="10.0.0.2",
                             remote_port=14579, remote_block_ids=[3, 9], remote_num_tokens=20,
                             remote_block_size=16, remote_host_id="h/b", transfer_id="cmpl-1-0",
                             compat_hash="abcd", compat={"dtype": "float32", "num_layers": 30})
VIEW = RequestView("req-1", prompt=12, computed=8, output=3, max_tokens=16, blocks=2, preempted=1)

# One filled-in example of every message type (the defaults are covered by the second test).
EXAMPLES = [
    EngineCoreRequest("req-1", [1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8,
                                                         stop=["\n"], logprobs=2, seed=7),
                      eos_token_ids=[2, 128009], arrival_time=1700000000.5, priority=3, cache_salt="s"),
    # a constraint that applies after the reasoning's end run (--reasoning-parser)
    EngineCoreRequest("req-2", [1, 2], SamplingParams(max_tokens=8, structured_outputs=(
        StructuredOutputsParams(json={"type": "object"}, reasoning_end_token_ids=[151668],
                                reasoning_start_token_ids=[151667])))),
    # a request under a LoRA adapter, and the core's answers to adding / removing one
    EngineCoreRequest("req-5", [1, 2], SamplingParams(max_tokens=4),
                      lora_request=LoRARequest("sql-lora", 3, "/adapters/sql")),
    LoRAResult("add", 3),
    LoRAResult("add", 4, error="LoRA adapter '/x': rank 64 is over max_lora_rank 16"),
    LoRAResult("remove", 3, found=False),
    EngineCoreReady(pid=123, model_path="/models/x.gguf", max_model_len=2048, num_blocks=512,
                    block_size=16, max_num_seqs=128, vocab_size=49152, startup_report="ready"),
    LOGPROBS,
    EngineCoreOutput("req-1", [5], [LOGPROBS], finish_reason="stop", stop_reason="\n",
                     num_cached_tokens=16, first_scheduled_time=1700000000.75),
    STATS,
    KV_STATS,
    # prefill/decode disaggregation: the pull's parameters in, the lent blocks' out
    EngineCoreRequest("req-3", [1, 2], SamplingParams(max_tokens=4, kv_transfer_params=KV_PARAMS)),
    EngineCoreOutput("req-4", [7], finish_reason="length", kv_transfer_params=KV_PARAMS),
    # embeddings: a pooling request in, its vector (float32 bytes) out; prompt logprobs
    EngineCoreRequest("req-5", [1, 2], SamplingParams(),
                      pooling_params=PoolingParams(normalize=False, pooling_type="MEAN")),
    EngineCoreOutput("req-5", [], finish_reason="stop", pooled=b"\x00\x00\x80?\x00\x00\x00@"),
    PromptLogprobsChunk(start=1, entries=[LOGPROBS, LOGPROBS]),
    EngineCoreOutput("req-6", [], prompt_logprobs=PromptLogprobsChunk(start=3, entries=[LOGPROBS])),
    SchedulerStats(num_free_blocks=3, kv_transfer=KV_STATS),
    EngineCoreOutputs([EngineCoreOutput("req-1", [5, 6]), EngineCoreOutput("req-2", [], finish_reason="abort")],
                      scheduler_stats=STATS, timestamp=1700000001.0),
    VIEW,
    StepTokens(step=4, prefill=12, decode=2),
    EngineSnapshot(time=1700000001.0, step=5, budget=64, max_num_seqs=8, block_size=16,
                   num_free_blocks=30, num_cached_free_blocks=4, num_waiting=1, running=[VIEW],
                   waiting=[RequestView("req-2", 5, 0, 0, 4, 0)],
                   steps=[StepTokens(4, 12, 2)], block_owners=[0, 1, 2, 3, 3]),
]


def message_types() -> set[type]:
    return {obj for _, obj in inspect.getmembers(protocol, inspect.isclass)
            if issubclass(obj, msgspec.Struct) and obj is not msgspec.Struct}


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == message_types()


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_message_round_trips_through_msgpack(msg):
    encoded = msgspec.msgpack.Encoder().encode(msg)
    assert msgspec.msgpack.Decoder(type(msg)).decode(encoded) == msg


@pytest.mark.parametrize("cls", sorted(message_types(), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_defaults_round_trip(cls):
    """A message with only its required fields comes back with the same defaults."""
    example = next(m for m in EXAMPLES if type(m) is cls)
    required = {f: getattr(example, f) for f, d in zip(cls.__struct_fields__, _defaults(cls))
                if d is msgspec.NODEFAULT}
    msg = cls(**required)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=cls) == msg


def _defaults(cls) -> list:
    fields, defaults = cls.__struct_fields__, cls.__struct_defaults__
    return [msgspec.NODEFAULT] * (len(fields) - len(defaults)) + list(defaults)


def test_snapshot_carries_the_block_legend():
    snap = next(m for m in EXAMPLES if isinstance(m, EngineSnapshot))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=EngineSnapshot).legend == BLOCK_LEGEND


def test_frames_and_utility_names_are_distinct():
    requests = [t.value for t in EngineCoreRequestType]
    core = [v for k, v in vars(CoreMessage).items() if not k.startswith("_")]
    calls = [v for k, v in vars(UtilityCall).items() if not k.startswith("_")]
    assert len(set(requests)) == len(requests) == 5
    assert len(set(core)) == len(core) == 7 and all(isinstance(v, bytes) for v in core)
    assert len(set(calls)) == len(calls) == 4 and all(isinstance(v, str) for v in calls)
