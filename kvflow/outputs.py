"""What users get back from generate(): RequestOutput holding one CompletionOutput per sample."""
from __future__ import annotations

import sys
from array import array
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
# One entry per prompt position: None for the first, then the prompt's token plus the top-N.
PromptLogprobs = list[dict[int, Logprob] | None]


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """Logprobs of the prompt positions one prefill chunk computed, as the runner makes them
    and the core sends them: `entries[i]` is position `start + i` (>= 1), the prompt's own
    token first, its rank in `sampled_rank`. A recomputed chunk (after a preemption) repeats
    positions already sent; the frontend keeps the first."""

    start: int
    entries: list[TokenLogprobs]


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
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first),
    # on the first output once the prompt is done
    prompt_logprobs: PromptLogprobs | None = None


def embedding_from_bytes(data: bytes) -> list[float]:
    """A pooled vector as the core sends it (float32, little-endian) -> floats."""
    vec = array("f")
    vec.frombytes(data)
    if sys.byteorder == "big":
        vec.byteswap()
    return vec.tolist()


@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector (vLLM's name)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns for each prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
