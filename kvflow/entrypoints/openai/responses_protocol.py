"""OpenAI Responses API request models (`POST /v1/responses`). Like protocol.py: unknown fields
are ignored, a field OpenAI defines and kvflow does not implement (`background`,
`conversation`, built-in tools, ...) is a 400 naming it, and every count and string is bounded.
Input items are checked one by one (`input_messages`) so that an error names `input[i]`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kvflow.entrypoints.openai.errors import APIError, validation_message
from kvflow.entrypoints.openai.protocol import (MAX_TOOLS, OpenAIBaseModel,
                                                StructuredOutputsRequest, _absent,
                                                _refuse_unimplemented)
from kvflow.entrypoints.openai.serving_engine import MAX_MESSAGES

MAX_INPUT_ITEMS = MAX_MESSAGES
MAX_CONTENT_PARTS = 256  # content parts of one input message
MAX_ID_CHARS = 256  # call ids, item ids, function names, previous_response_id
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's own limits

BUILTIN_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "file_search",
                 "code_interpreter", "computer_use_preview", "computer", "image_generation",
                 "mcp", "local_shell", "shell", "apply_patch", "custom")

_UNIMPLEMENTED_RESPONSES = {
    "background": lambda v, body: _absent(v),
    "conversation": lambda v, body: v is None,
    "include": lambda v, body: _absent(v),
    "prompt": lambda v, body: v is None,
    "max_tool_calls": lambda v, body: v is None,
    "top_logprobs": lambda v, body: v is None or v == 0,
    "truncation": lambda v, body: v is None or v == "disabled",
    "stream_options": lambda v, body: v is None or set(v) <= {"include_obfuscation"},
    "context_management": lambda v, body: _absent(v),
    # OpenAI's reasoning knobs: kvflow cannot tell a model how hard to think
    "reasoning": lambda v, body: v is None or all(x is None for x in v.values()),
}


class InputText(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "refusal", "text"]
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class InputImage(OpenAIBaseModel):
    """An image: `image_url` is read like the chat API's (a data URL, or a URL the server's
    options allow); uploaded files (`file_id`) are not implemented."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: None = None
    detail: str = "auto"

    @model_validator(mode="after")
    def _has_url(self):
        if self.image_url is None:
            raise ValueError("an input_image needs its image_url")
        return self

    def chat_part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": self.detail}}


# (a count on `str | list` is given to the list alone: on the union it would cap the string)
class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputText | InputImage], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.value() for p in self.content if isinstance(p, InputText))

    def chat_content(self) -> str | list[dict]:
        """The content as the chat path takes it: text, or its parts in order when it holds an
        image (part j stays part j, so that a refusal's name maps back)."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage)
                                                    for p in self.content):
            return self.text()
        return [p.chat_part() if isinstance(p, InputImage) else {"type": "text", "text": p.value()}
                for p in self.content]


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    arguments: str = ""
    id: str | None = Field(None, max_length=MAX_ID_CHARS)


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.value() for p in self.output)


class ReasoningItem(OpenAIBaseModel):
    """An earlier turn's reasoning handed back: accepted, and left out of the prompt (chat
    templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]


ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_CONTENT_TYPES = ("input_text", "output_text", "refusal", "text")


def _item_error(where: str, e: ValidationError) -> APIError:
    message, _ = validation_message(e.errors())
    return APIError(400, f"{where}.{message}", param=where, code="invalid_value")


def input_items(raw: str | list[dict]) -> list:
    """The request's `input` as items; a 400 naming `input[i]` for one kvflow cannot read."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported (kvflow reads "
                                f"{', '.join(ITEM_TYPES)})", param=where, code="unsupported_item")
        if kind in ("message", "function_call_output"):
            parts = item.get("content" if kind == "message" else "output")
            # images in a user's (or system's) message only
            images = kind == "message" and item.get("role") != "assistant"
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in _CONTENT_TYPES and not (images and ptype == "input_image"):
                    raise APIError(400, f"{where}.content[{j}].type: {str(ptype)[:64]!r} content "
                                        "is not supported here (input_text, output_text; "
                                        "input_image in a user message)",
                                   param=where, code="unsupported_content")
                if ptype == "input_image" and part.get("file_id") is not None:
                    at = f"{where}.content[{j}]"
                    raise APIError(400, f"{at}.file_id: uploaded files are not implemented; "
                                        "send the image as image_url (a data URL)", param=at,
                                   code="unsupported_content")
        try:
            items.append(model.model_validate(item))
        except ValidationError as e:
            raise _item_error(where, e) from None
    return items


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=MAX_ID_CHARS)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # low / high cannot be honoured


class FunctionTool(OpenAIBaseModel):
    type: str
    name: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_only(self):
        if self.type != "function":
            kind = "a built-in tool" if self.type in BUILTIN_TOOLS else "a tool type"
            raise ValueError(f"{self.type!r} is {kind} kvflow does not implement; only "
                             "function tools")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's: as in chat
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    user: str | None = Field(None, max_length=MAX_ID_CHARS)
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, body: Any) -> Any:
        _refuse_unimplemented(body, _UNIMPLEMENTED_RESPONSES)
        return body

    @field_validator("metadata")
    @classmethod
    def _short_metadata(cls, value):
        if value and any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                         for k, v in value.items()):
            raise ValueError(f"keys of at most {MAX_METADATA_KEY} characters, values of at "
                             f"most {MAX_METADATA_VALUE}")
        return value
