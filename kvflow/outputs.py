"""What users get back from generate(): RequestOutput holding one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one generated position, as the sampler makes them and the core sends them:
    the sampled token first, then the top-N (turned into Logprob dicts by the frontend)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token under the model's distribution


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # a prefill instance's answer to `do_remote_decode`: where its lent blocks are
    kv_transfer_params: dict | None = None
