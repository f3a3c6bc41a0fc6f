"""OpenAI API request models (pydantic). They accept and ignore unknown fields, so that
clients written for OpenAI or vLLM work unchanged. Responses are built as plain dicts in the
serving modules (one shape per chunk, cheap to encode)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvflow.sampling_params import SamplingParams

SEED_RANGE = dict(ge=-(2**63), le=2**64 - 1)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat; the engine's extensions follow vLLM's names."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Prefix caching: requests share cached blocks only when their salts are equal.
    cache_salt: str | None = Field(None, max_length=1024)
    # With --scheduling-policy priority: lower values are served first.
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field and its limit."""
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), seed=self.seed,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages: content part of type {part.type!r} is not supported "
                                 "(only text)")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


# -- other endpoints -----------------------------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
