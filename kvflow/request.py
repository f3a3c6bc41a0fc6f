"""Request: one sequence's state as the scheduler sees it."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    WAITING_FOR_GRAMMAR = 6  # queued, its grammar still compiling: admission passes it over
    WAITING_FOR_REMOTE_KV = 7  # queued, its prompt's KV being pulled from a prefill instance

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def eos_ids(eos: int | Sequence[int] | None) -> tuple[int, ...]:
    """Every EOS id as a tuple: a config gives one id, a list (Llama 3.1: end of text, end of
    turn, end of message) or none."""
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where an item's placeholder tokens sit in the prompt: [offset, offset + length)."""

    offset: int
    length: int


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One image of a request as the engine carries it (vLLM's name): its placeholder run in
    the prompt, its content hash (`identifier`: the prefix cache's key for the run's blocks)
    and the model's encoder input, float32 pixel values in C order of `shape` (bytes, so that
    the message to the engine core stays plain msgpack)."""

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: bytes = b""
    shape: tuple[int, ...] = ()
    # the grid (t, h, w) its placeholder tokens lie on, for a model that places them on one
    # (Qwen3-VL's M-RoPE); empty otherwise
    grid: tuple[int, ...] = ()

    @property
    def offset(self) -> int:
        return self.mm_position.offset

    @property
    def length(self) -> int:
        return self.mm_position.length

    @property
    def end(self) -> int:
        return self.mm_position.offset + self.mm_position.length


@dataclass(eq=False)
class Request:
    """A prompt plus what has been generated so far. `num_computed_tokens` says how many of
    `all_token_ids` have their K/V in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | Sequence[int] | None = None  # one id or several (Llama 3.1: a list)
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    # an embedding request: prefill only, it ends with its prompt (its pooled vector is the
    # runner's); its sampling_params are not used
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    # its images, in prompt order (their placeholder runs do not overlap)
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    # its decoding constraint, when it has one: a kvflow.structured StructuredOutputRequest
    # (compiling, then the matcher). The scheduler only calls is_ready(), error, accept(token),
    # is_terminated() and close() on it, so that core/ never imports a grammar library.
    structured_output: Any = None
    # the output index from which its constraint applies (masks and matcher): 0, or, with
    # `structured_outputs.reasoning_end_token_ids`, the index after that run's first
    # occurrence; None while the output is still reasoning (or, with a start run, while it may
    # still begin with it: `reasoning_undecided`). Outputs survive a preemption, so this does too.
    constraint_start: int | None = field(default=0, init=False)
    reasoning_undecided: bool = field(default=False, init=False)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    num_skips: int = 0  # times admission passed over it for lack of blocks
    first_scheduled_time: float | None = None  # when it first left the waiting queue (time.time())
    stop_reason: int | str | None = None
    # speculative decoding: the drafts proposed for its next step (never part of
    # all_token_ids), and how many of its drafts were checked and accepted so far
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    all_token_ids: list[int] = field(init=False)
    eos_token_ids: tuple[int, ...] = field(init=False)  # every id that ends it

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        self.eos_token_ids = eos_ids(self.eos_token_id)
        so = self.sampling_params.structured_outputs
        self._reasoning_end: tuple[int, ...] = tuple(
            (so.reasoning_end_token_ids or ()) if so is not None else ())
        self._reasoning_start: tuple[int, ...] = tuple(
            (so.reasoning_start_token_ids or ()) if self._reasoning_end else ())
        self.constraint_start = None if self._reasoning_end else 0
        self.reasoning_undecided = bool(self._reasoning_start)
        for i in range(len(self.output_token_ids)):  # outputs given up front: replay them
            self._track_reasoning(i + 1)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def block_salt(self) -> str | tuple[str | None, int] | None:
        """What its first prefix-cache block's key holds besides tokens: the cache salt, and
        its adapter's id (a block computed under one adapter holds that adapter's K/V: never
        served to another, nor to the base model)."""
        if self.lora_request is None:
            return self.cache_salt
        return (self.cache_salt, self.lora_request.lora_int_id)

    def block_mm_keys(self, i: int, block_size: int) -> tuple[str, ...]:
        """The content hashes of the images whose placeholder runs overlap block i: a block's
        K/V depend on the images it holds, not only on its (placeholder) token ids."""
        lo, hi = i * block_size, (i + 1) * block_size
        return tuple(f.identifier for f in self.mm_features if f.offset < hi and f.end > lo)

    @property
    def salt_bytes(self) -> bytes:
        """block_salt as its blocks' hashes take it: the salt's UTF-8, then 0xff (a byte that
        UTF-8 never holds, so no salt can pose as an adapter) and the adapter's id."""
        return block_salt_bytes(self.cache_salt, self.lora_int_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        if self.pooling_params is not None:
            return 0  # prefill only: no decode slot, its blocks go when its prompt is done
        return self.sampling_params.max_tokens or 0

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def prefix_cache_bypass(self) -> str | None:
        """Why this request may not start from prefix-cache hits (None: it may): its prompt
        logprobs, or a pooling that reads every position, need each prompt position computed."""
        if self.sampling_params.prompt_logprobs is not None and self.pooling_params is None:
            return "prompt_logprobs"
        if self.pooling_params is not None and self.pooling_params.needs_every_position:
            return "pooling"
        return None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def constraint_active(self) -> bool:
        """Whether its constraint masks the next token (and its matcher accepts it)."""
        return self.constraint_start is not None

    @property
    def reasoning_start_next(self) -> int | None:
        """While it may still begin with the reasoning's start run: that run's next token,
        which its mask allows besides the grammar's."""
        if not self.reasoning_undecided:
            return None
        return self._reasoning_start[len(self.output_token_ids)]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.constraint_start is None:
            self._track_reasoning(len(self.output_token_ids))

    def _track_reasoning(self, n: int) -> None:
        """After the first `n` outputs: still undecided, reasoning, or constrained. Only the
        tail is read, O(len(run)) a token."""
        if self.constraint_start is not None:
            return
        out = self.output_token_ids
        if self.reasoning_undecided:
            start = self._reasoning_start
            if out[n - 1] != start[n - 1]:
                self.reasoning_undecided = False  # no reasoning: constrained from the start
                self.constraint_start = 0
            elif n == len(start):
                self.reasoning_undecided = False  # it reasons, until the end run
            return
        end = self._reasoning_end
        k = len(end)
        if n >= k and tuple(out[n - k:n]) == end:
            self.constraint_start = n


class InvalidRequestError(ValueError):
    """A request that can never run; `param` names the field to change (OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_request_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       block_size: int | None = None, num_blocks: int | None = None,
                       min_tokens: int = 0) -> int:
    """The one check that a request can ever run: a non-empty prompt that, with `max_tokens`
    (None: as many as fit), stays within `max_model_len` and, when the pool is given, within
    `num_blocks` blocks of `block_size`, and whose `min_tokens` fits in the max_tokens it gets
    (resolved from max_model_len when None). Returns max_tokens (resolved when None); raises
    InvalidRequestError naming the numbers and the field to change."""
    n = num_prompt_tokens
    if n == 0:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if max_tokens is None:
        if n >= max_model_len:
            raise InvalidRequestError(f"prompt has {n} tokens; max_model_len is {max_model_len}",
                                      "prompt")
        max_tokens = max_model_len - n
        if min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}: what "
                f"max_model_len leaves after the prompt)", "min_tokens")
    elif n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} is over "
            f"max_model_len {max_model_len}", "max_tokens")
    if block_size is not None and num_blocks is not None:
        total = n + max_tokens
        blocks = -(-total // block_size)
        if blocks > num_blocks:
            raise InvalidRequestError(
                f"prompt and max_tokens need {total} tokens ({blocks} KV blocks) but the KV cache "
                f"holds only {num_blocks} blocks; lower max_tokens", "max_tokens")
    return max_tokens


def block_salt_bytes(cache_salt: str | None, lora_int_id: int = 0) -> bytes:
    """Request.salt_bytes from its parts (`lora_int_id` 0: the base model), for whoever hashes
    a prompt's blocks without a Request (a router scoring replicas by their KV events)."""
    salt = cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
    if not lora_int_id:
        return salt
    return salt + b"\xff" + lora_int_id.to_bytes(8, "little")
