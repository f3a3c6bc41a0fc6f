"""Every message between the frontend and the engine-core process (msgspec structs, msgpack on
the wire), and the frame that says which one follows.

    frontend -> core:  [EngineCoreRequestType, payload]
        ADD      EngineCoreRequest
        ABORT    list[str]             core request ids
        UTILITY  [UtilityCall name]    answered (where it has an answer) by a UTILITY message
        ADD_LORA     LoRARequest       load and register an adapter; answered by LORA
        REMOVE_LORA  LoRARequest       unregister it (by lora_int_id); answered by LORA
    core -> frontend:  [CoreMessage, payload]
        READY      EngineCoreReady      once, after the model is loaded
        OUTPUTS    EngineCoreOutputs    after every step
        REQ_ERROR  [request id, text]   add_request refused it
        FAILED     str                  start-up failed or the loop crashed; the process exits
        SNAPSHOT   EngineSnapshot       at most every 250 ms while a dashboard watches
        UTILITY    [call name, result]  the answer to a utility call
        LORA       LoRAResult           the answer to ADD_LORA / REMOVE_LORA

KV-transfer messages between instances are in kvflow.kv_transfer.messages."""
from __future__ import annotations

import enum
import time

import msgspec

from kvflow.kv_transfer.params import KVTransferParams
from kvflow.kv_transfer.stats import KVTransferStats  # noqa: F401 - part of the protocol
from kvflow.lora_request import LoRARequest
from kvflow.outputs import PromptLogprobsChunk, TokenLogprobs
from kvflow.pooling_params import PoolingParams
from kvflow.request import MultiModalFeatureSpec
from kvflow.sampling_params import SamplingParams


# -- frames --------------------------------------------------------------------------------
class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a frontend -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    ADD_LORA = b"\x03"
    REMOVE_LORA = b"\x04"


class CoreMessage:
    """First frame of a core -> frontend message (plain bytes: compared on every message)."""

    READY = b"R"      # EngineCoreReady
    OUTPUTS = b"O"    # EngineCoreOutputs
    REQ_ERROR = b"E"  # [core request id, message]: add_request refused it
    FAILED = b"F"     # str: startup failed or the loop crashed; the process then exits
    SNAPSHOT = b"S"   # EngineSnapshot, at most every 250 ms while a dashboard watches
    UTILITY = b"U"    # [call name, result]: the answer to a utility call
    LORA = b"L"       # LoRAResult: the answer to ADD_LORA / REMOVE_LORA


class UtilityCall:
    """Names of the utility calls (the payload of an UTILITY request is `[name]`)."""

    SHUTDOWN = "shutdown"  # stop the loop
    SNAPSHOTS_ON = "snapshots_on"  # a dashboard watches
    SNAPSHOTS_OFF = "snapshots_off"  # no more
    RESET_PREFIX_CACHE = "reset_prefix_cache"  # answered with True, or False while requests run


# -- frontend -> core ------------------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] | None = None  # None: every EOS id of the model
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # an embedding request (prefill only; its sampling_params are not used)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    # passed the frontend's input processor: the core only asserts its invariants (False: the
    # core runs the same input processor on it, for callers that hand it requests directly)
    checked: bool = False
    # its images, processed (kvflow/multimodal/processor.py): placeholder runs, hashes, pixels
    mm_features: list[MultiModalFeatureSpec] | None = None


# -- core -> frontend ------------------------------------------------------------------------
class EngineCoreReady(msgspec.Struct, array_like=True):
    """What the frontend needs to know once the model is loaded."""

    pid: int
    model_path: str
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    vocab_size: int
    startup_report: str
    supports_images: bool = False  # the model takes images (multi_modal_data)


class LoRAResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """The core's answer to ADD_LORA / REMOVE_LORA: `error` says why it refused (nothing
    changed then); `found` whether REMOVE_LORA found the adapter."""

    op: str  # "add" | "remove"
    lora_int_id: int
    error: str | None = None
    found: bool = True


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # when the request first left the waiting queue
    kv_transfer_params: KVTransferParams | None = None  # its prompt's blocks, lent: where to pull
    pooled: bytes | None = None  # an embedding request's vector (float32, little-endian), at its end
    prompt_logprobs: PromptLogprobsChunk | None = None  # what this step's prompt chunk scored


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0  # since the previous stats
    num_prompt_tokens: int = 0  # scheduled this step
    num_generation_tokens: int = 0
    step_time: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0  # of which found in the cache
    # speculative decoding, since start: draft runs checked, their tokens, of which accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    kv_transfer: KVTransferStats | None = None  # with --kv-transfer-config
    num_encoder_tokens: int = 0  # image tokens encoded this step (within the prompt tokens)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.time)


# -- dashboard snapshots (core -> frontend; built by kvflow.engine.snapshot) ------------------
# block_owners codes; a code >= OWNER_BASE is `OWNER_BASE + i` for the block's holder running[i].
# HELD (held, holder not shown) replaces SHARED on a dashboard served without
# --enable-prompt-tokens-details: a shared block tells a tenant that its prompt hit the cache.
FREE, CACHED_FREE, SHARED, HELD = 0, 1, 2, 3
OWNER_BASE = 4
BLOCK_LEGEND = {"free": FREE, "cached_free": CACHED_FREE, "shared": SHARED, "held": HELD,
                "owner_base": OWNER_BASE}


class RequestView(msgspec.Struct):
    """One request's progress: prompt computed of prompt length, output of max_tokens."""

    id: str
    prompt: int  # prompt tokens
    computed: int  # prompt tokens whose K/V are in the cache (capped at `prompt`)
    output: int  # tokens generated so far
    max_tokens: int
    blocks: int  # KV blocks held
    preempted: int = 0  # times it was preempted


class StepTokens(msgspec.Struct, array_like=True):
    """Tokens one step scheduled, split by phase; `encoder`: of the prefill tokens, the image
    tokens whose encoder ran in this step."""

    step: int
    prefill: int
    decode: int
    encoder: int = 0


class EngineSnapshot(msgspec.Struct):
    """What the dashboard draws. `block_owners[b]` says who holds block b (see BLOCK_LEGEND):
    free, cached-free (free but still findable by prefix), shared (ref_cnt > 1), or the index of
    its holder in `running`."""

    time: float
    step: int
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    block_size: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_waiting: int
    running: list[RequestView]
    waiting: list[RequestView]  # the first MAX_WAITING_SHOWN
    steps: list[StepTokens]
    block_owners: list[int]
    legend: dict[str, int] = msgspec.field(default_factory=lambda: dict(BLOCK_LEGEND))
