"""Anthropic Messages API request models. Unknown fields are ignored (as Anthropic's own API
does for forward compatibility of clients), a field or content block kvflow does not implement
(documents, server tools, extended thinking, ...) is a 400 naming it, and every count
and string is bounded. Content blocks are read one by one (`blocks_of`) so that an error names
`messages[i].content[j]`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvflow.entrypoints.openai.errors import APIError, validation_message
from kvflow.entrypoints.openai.protocol import MAX_TOOLS, OpenAIBaseModel, _absent
from kvflow.entrypoints.openai.serving_engine import MAX_MESSAGES

MAX_BLOCKS = 256  # content blocks of one message, text blocks of `system`
MAX_ID_CHARS = 256  # tool_use ids, tool names

# fields Anthropic defines and kvflow does not implement: name -> "is this value harmless?"
_UNIMPLEMENTED = {
    "thinking": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled"),
    "container": lambda v: v is None,
    "mcp_servers": lambda v: _absent(v),
    "context_management": lambda v: _absent(v),
    "output_format": lambda v: v is None,
    "service_tier": lambda v: v is None or v in ("auto", "standard_only"),
    "speed": lambda v: v is None or v == "standard",
}


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(OpenAIBaseModel):
    """An earlier answer's thinking handed back: accepted and left out of the prompt (chat
    templates drop earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


class ImageSource(OpenAIBaseModel):
    """An image block's source: base64 with its media type, or a URL (read like OpenAI's
    image_url: from --allowed-media-domains only). Anthropic's Files API (`file`) is not
    implemented."""

    type: Literal["base64", "url"]
    media_type: str | None = Field(None, max_length=64)
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self):
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 source needs media_type and data")
        if self.type == "url" and self.url is None:
            raise ValueError("a url source needs its url")
        return self


class ImageBlock(OpenAIBaseModel):
    type: Literal["image"]
    source: ImageSource

    def chat_part(self) -> dict:
        """The chat path's image_url part for this image (a base64 source as a data URL)."""
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if src.type == "base64" else src.url
        return {"type": "image_url", "image_url": {"url": url}}


BLOCK_TYPES = {"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
               "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock}


def blocks_of(content: str | list[dict], where: str) -> list:
    """A message's content as blocks; a 400 naming `where.content[j]` for one kvflow cannot
    read."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    blocks = []
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = raw.get("type")
        model = BLOCK_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(400, f"{at}.type: {kind!r} content blocks are not supported (kvflow "
                                "reads text, image, tool_use and tool_result)", param=at,
                           code="unsupported_content")
        if kind == "tool_result" and isinstance(raw.get("content"), list):
            for k, part in enumerate(raw["content"]):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else part
                    raise APIError(400, f"{at}.content[{k}].type: {kind!r} is not supported in "
                                        "a tool_result (only text)", param=at,
                                   code="unsupported_content")
        try:
            blocks.append(model.model_validate(raw))
        except ValidationError as e:
            message, _ = validation_message(e.errors())
            raise APIError(400, f"{at}.{message}", param=at, code="invalid_value") from None
    return blocks


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)]


class Tool(OpenAIBaseModel):
    type: str | None = None
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _custom_only(self):
        if self.type not in (None, "custom"):
            raise ValueError(f"{self.type!r} is a server tool kvflow does not implement; only "
                             "custom tools (name, description, input_schema)")
        if self.input_schema is None:
            raise ValueError("a tool needs an input_schema")
        return self


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('a name is given with type "tool", and only then')
        return self


class OutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    """Structured outputs (`format`) through kvflow's grammar path; `effort` cannot be
    honoured."""

    effort: None = None
    format: OutputFormat | None = None


class Metadata(OpenAIBaseModel):
    user_id: str | None = Field(None, max_length=MAX_ID_CHARS)


class _Request(OpenAIBaseModel):
    model: str = Field(max_length=MAX_ID_CHARS)
    messages: list[MessageParam] = Field(max_length=MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, harmless in _UNIMPLEMENTED.items():
                if name in body and not harmless(body[name]):
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{param}: kvflow does not implement this field; leave it out",
                        {"param": name})
        return body

    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "".join(b.text for b in self.system)


class MessagesRequest(_Request):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    @field_validator("temperature")
    @classmethod
    def _anthropic_range(cls, value):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"must be in [0, 1], got {value}")
        return value


class CountTokensRequest(_Request):
    pass
