"""OpenAI API request models (pydantic). Unknown fields are ignored, as OpenAI does, so that
clients written for OpenAI or vLLM work unchanged; but a field that OpenAI or vLLM defines and
kvflow does not implement (`best_of`, `audio`, ...) is refused with a 400 naming it, never
silently ignored; so are vLLM's removed `guided_*` fields, naming `structured_outputs`. Every string is checked for lone surrogates (a JSON
"\\ud800" escape), which nothing downstream could encode. Responses are built as plain dicts in
the serving modules (one shape per chunk, cheap to encode)."""
from __future__ import annotations

import json

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvflow.kv_transfer.params import MAX_ID_CHARS, MAX_REMOTE_BLOCKS, KVTransferParams
from kvflow.sampling_params import (SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams,
                                    find_lone_surrogate)

SEED_RANGE = dict(ge=SEED_MIN, le=SEED_MAX)


def _check_strings(value: Any, where: str) -> None:
    """Walk a parsed value (nested models check their own fields) for lone surrogates."""
    if isinstance(value, str):
        at = find_lone_surrogate(value)
        if at is not None:
            raise ValueError(f"{where} is not valid Unicode: a lone surrogate "
                             f"(\\u{ord(value[at]):04x}) at position {at}")
    elif isinstance(value, (list, tuple)):
        # lists are homogeneous once parsed: a list of ids (or of models) is skipped in O(1)
        if value and isinstance(value[0], _NESTED):
            for v in value:
                _check_strings(v, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) and not isinstance(v, _NESTED):
                return  # logit_bias: int -> float
            _check_strings(k, where)
            _check_strings(v, where)


_NESTED = (str, list, tuple, dict)


def _absent(value) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


# Fields that OpenAI or vLLM define and kvflow does not implement: name -> "is this value the
# harmless default?". Any other value is a 400 naming the field.
_UNIMPLEMENTED_COMMON: dict[str, Any] = {
    "best_of": lambda v, body: v is None or v == body.get("n", 1),
    "use_beam_search": lambda v, body: _absent(v),
    "length_penalty": lambda v, body: v is None or v == 1 or v == 1.0,
    "allowed_token_ids": lambda v, body: v is None,
    "bad_words": lambda v, body: _absent(v),
    "truncate_prompt_tokens": lambda v, body: v is None,
    "logits_processors": lambda v, body: _absent(v),
    "return_tokens_as_token_ids": lambda v, body: _absent(v),
    "spaces_between_special_tokens": lambda v, body: v is None or v is True,
}
_UNIMPLEMENTED_COMPLETION = {
    **_UNIMPLEMENTED_COMMON,
    "suffix": lambda v, body: v is None or v == "",
    "prompt_embeds": lambda v, body: v is None,
}
_UNIMPLEMENTED_CHAT = {
    **_UNIMPLEMENTED_COMMON,
    "functions": lambda v, body: _absent(v),
    "function_call": lambda v, body: v is None or v in ("none", "auto"),
    "audio": lambda v, body: v is None,
    "modalities": lambda v, body: v is None or v == ["text"],
    "prediction": lambda v, body: v is None,
    "web_search_options": lambda v, body: v is None,
    "reasoning_effort": lambda v, body: v is None,
    "echo": lambda v, body: _absent(v),
    "continue_final_message": lambda v, body: _absent(v),
    "chat_template": lambda v, body: v is None,
    "documents": lambda v, body: v is None,
    "add_special_tokens": lambda v, body: _absent(v),
}


# vLLM's removed constraint fields: vLLM now ignores them (unconstrained output, silently);
# kvflow names what replaced them.
_REMOVED = {
    "guided_json": 'use structured_outputs: {"json": SCHEMA} or response_format',
    "guided_regex": 'use structured_outputs: {"regex": ...}',
    "guided_choice": 'use structured_outputs: {"choice": [...]}',
    "guided_grammar": 'use structured_outputs: {"grammar": ...}',
    "guided_json_object": 'use response_format: {"type": "json_object"}',
    "guided_whitespace_pattern": "give the constraint as structured_outputs",
    "guided_decoding_backend": "give the constraint as structured_outputs (the server chooses "
                               "the backend)",
}


def _refuse_unimplemented(body: Any, table: dict[str, Any]) -> None:
    if not isinstance(body, dict):
        return
    for name, instead in _REMOVED.items():
        if body.get(name) is not None:
            raise PydanticCustomError("removed_field", "{param} was removed; " + instead,
                                      {"param": name})
    for name, harmless in table.items():
        if name in body:
            try:
                ok = harmless(body[name], body)
            except Exception:  # noqa: BLE001 - an odd value (unhashable, ...) is not the default
                ok = False
            if not ok:
                raise PydanticCustomError(
                    "unsupported_field",
                    "{param}: kvflow does not implement this field; leave it out"
                    + (" (or set it equal to n)" if name == "best_of" else ""),
                    {"param": name})


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        try:
            _check_strings(value, info.field_name)
        except RecursionError:  # a free-form field (a dict, a list of dicts) the parser let by
            raise ValueError(f"{info.field_name} is nested too deeply") from None
        return value


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# -- constraints -----------------------------------------------------------------------
class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: text (no constraint), json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` field. A key kvflow does not know is refused: ignoring it
    would give unconstrained output where the client asked for a constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def constraint_of(response_format: ResponseFormat | None,
                  structured_outputs: StructuredOutputsRequest | None) -> StructuredOutputsParams | None:
    """The request's decoding constraint; ValueError naming the field when it is not one."""
    rf = response_format if response_format is not None and response_format.type != "text" else None
    if rf is not None and structured_outputs is not None:
        raise ValueError("structured_outputs: give either response_format or structured_outputs, "
                         "not both")
    try:
        if rf is not None and rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf is not None:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError('response_format: type "json_schema" needs json_schema.schema')
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        if structured_outputs is not None:
            so = structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                           grammar=so.grammar, json_object=bool(so.json_object))
    except RecursionError:
        raise ValueError("structured_outputs: the schema is nested too deeply") from None
    return None


class KVTransferParamsRequest(OpenAIBaseModel):
    """vLLM's `kv_transfer_params` (prefill/decode disaggregation, docs/disaggregation.md). An
    unknown key is refused: a transfer that silently lost a field would move the wrong blocks."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    remote_host: str | None = Field(None, max_length=MAX_ID_CHARS)
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_block_ids: list[int] | None = Field(None, max_length=MAX_REMOTE_BLOCKS)
    remote_num_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    remote_block_size: int | None = Field(None, ge=1, le=4096)
    remote_host_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    transfer_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    compat_hash: str | None = Field(None, max_length=MAX_ID_CHARS)
    compat: dict[str, str | int] | None = Field(None, max_length=32)

    @field_validator("compat")
    @classmethod
    def _short_values(cls, value):
        if value and any(len(k) > MAX_ID_CHARS or (isinstance(v, str) and len(v) > MAX_ID_CHARS)
                         for k, v in value.items()):
            raise ValueError(f"kv_transfer_params.compat: keys and values of at most "
                             f"{MAX_ID_CHARS} characters")
        return value

    def params(self) -> KVTransferParams:
        return KVTransferParams(**self.model_dump())


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat; the engine's extensions follow vLLM's names.
    Values are checked by SamplingParams (one place for the limits)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    kv_transfer_params: KVTransferParamsRequest | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
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
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=constraint_of(self.response_format, self.structured_outputs),
            kv_transfer_params=self._kv_transfer_params())

    def _kv_transfer_params(self) -> KVTransferParams | None:
        kt = self.kv_transfer_params
        if kt is None or not (kt.do_remote_decode or kt.do_remote_prefill):
            return None
        if self.n != 1:
            raise ValueError("kv_transfer_params: n must be 1 (one transfer per request)")
        return kt.params()


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = None
    # vLLM's: each choice carries `prompt_logprobs`, the prompt's tokens and their top-N
    prompt_logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: BOS (and the like) before a text prompt

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, body: Any) -> Any:
        _refuse_unimplemented(body, _UNIMPLEMENTED_COMPLETION)
        return body


MAX_CONTENT_PARTS = 256  # content parts of one message


class ContentPart(OpenAIBaseModel):
    """A content part: `text`, or `image_url` (read by kvflow/multimodal/media.py); any other
    type is refused by name when the conversation is templated."""

    type: str = Field(max_length=64)
    text: str | None = None
    image_url: dict[str, Any] | str | None = None

    def as_dict(self) -> dict:
        return {"type": self.type, "text": self.text, "image_url": self.image_url}


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    # (the count is given to the list alone: on the union it would cap the string)
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this answers


MAX_TOOLS = 128


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


# chat_template_kwargs: extra variables for the chat template (vLLM's field; e.g. Qwen3's and
# SmolLM3's `enable_thinking`). Bounded, JSON values only, and never one of the names that
# apply_chat_template itself takes.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16384
_TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` bounded: at most MAX_TEMPLATE_KWARGS identifier keys, JSON of at
    most MAX_TEMPLATE_KWARGS_CHARS characters, no name apply_chat_template reserves."""
    if not value:
        return None
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} keys")
    for key in value:
        if not (key.isidentifier() and len(key) <= 64):
            raise ValueError(f"chat_template_kwargs: {key[:64]!r} is not a name of at most 64 characters")
        if key in _TEMPLATE_RESERVED:
            raise ValueError(f"chat_template_kwargs: {key!r} is set by its own request field")
    if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON")
    return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's: the response carries `prompt_logprobs`, the rendered prompt's tokens and their
    # top-N (not with stream, as in vLLM)
    prompt_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, body: Any) -> Any:
        _refuse_unimplemented(body, _UNIMPLEMENTED_CHAT)
        return body

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


# -- other endpoints -----------------------------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
