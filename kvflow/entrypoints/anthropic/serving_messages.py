"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

A message is a chat completion underneath: `system` and the messages' blocks become chat
messages (a `tool_use` block an assistant's tool call, a `tool_result` block a `tool`
message), the chat path templates, checks, constrains (tool_choice any / tool) and reads tool
calls and reasoning; `MessageStream` turns its chunks into content blocks and Anthropic's
events. The non-streamed message is the same events' final state."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvflow.entrypoints.anthropic.errors import (AnthropicRoute, anthropic_error_body,
                                                 as_anthropic)
from kvflow.entrypoints.anthropic.protocol import (CountTokensRequest, ImageBlock,
                                                   MessagesRequest, TextBlock, ToolResultBlock,
                                                   ToolUseBlock, _Request, blocks_of)
from kvflow.entrypoints.openai.errors import APIError, renamed, validation_message
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat, tool_dicts
from kvflow.entrypoints.openai.serving_engine import STREAM_ERRORS, until_disconnected
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS

_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "response_format": "output_config.format", "structured_outputs": "output_config.format"}


def chat_messages(req: _Request, names: dict[str, str] | None = None) -> list[dict]:
    """`system` and the messages as chat messages; a 400 naming the block kvflow cannot read.
    An image block becomes an image_url part, and `names` maps that part's name on the chat
    path (`messages[k].content[j]`) to the block's (`messages[i].content[j']`)."""
    names = {} if names is None else names
    messages = [{"role": "system", "content": req.system_text()}] if req.system else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        blocks = blocks_of(m.content, where)
        if m.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise APIError(400, f"{where}: a tool_result block belongs in a user message",
                               param=where, code="invalid_value")
            for j, b in enumerate(blocks):
                if isinstance(b, ImageBlock):
                    at = f"{where}.content[{j}]"
                    raise APIError(400, f"{at}: an image block belongs in a user message",
                                   param=at, code="invalid_value")
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": b.input}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            message: dict = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            continue
        parts: list[tuple[dict, str | None]] = []  # (chat part, the image block's name)

        def flush() -> None:
            if not any(at for _, at in parts):
                messages.append({"role": "user", "content": "".join(p["text"] for p, _ in parts)})
            else:
                for j, (_, at) in enumerate(parts):
                    if at is not None:
                        names[f"messages[{len(messages)}].content[{j}]"] = at
                messages.append({"role": "user", "content": [p for p, _ in parts]})
            parts.clear()

        for j, b in enumerate(blocks):
            if isinstance(b, ToolUseBlock):
                raise APIError(400, f"{where}: a tool_use block belongs in an assistant message",
                               param=where, code="invalid_value")
            if isinstance(b, ToolResultBlock):
                if parts:
                    flush()
                content = b.text()
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {content}" if b.is_error else content})
            elif isinstance(b, TextBlock):
                parts.append(({"type": "text", "text": b.text}, None))
            elif isinstance(b, ImageBlock):
                parts.append((b.chat_part(), f"{where}.content[{j}]"))
        if parts or not blocks:
            flush()
    return messages


def _tools_and_choice(req: _Request) -> dict:
    body: dict = {}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return body


def chat_request(req: MessagesRequest, auto_tools: bool,
                 names: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat completion that serves `req`; `auto_tools`: the server reads the model's own
    tool calls (--tool-call-parser), which tool_choice auto needs. `names`: as in
    chat_messages."""
    if req.messages and req.messages[-1].role == "assistant":
        at = f"messages[{len(req.messages) - 1}]"
        raise APIError(400, f"{at}: a final assistant message (a prefill for the model to "
                            "continue) is not supported; end with a user message",
                       param=at, code="unsupported_value")
    body = {"model": None, "messages": chat_messages(req, names), "max_tokens": req.max_tokens,
            "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "user": req.metadata.user_id if req.metadata else None,
            **_tools_and_choice(req)}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
    if req.tools and body.get("tool_choice", "auto") == "auto" and not auto_tools:
        raise APIError(400, 'tool_choice: {"type": "auto"} (the default with tools) needs the '
                            f"server started with --tool-call-parser ({', '.join(TOOL_PARSERS)}); "
                            'or use {"type": "any"} or {"type": "tool", "name": ...}',
                       param="tool_choice", code="invalid_value")
    return validated(body)


def validated(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise renamed(APIError(400, message, param, "invalid_value"), _PARAMS) from None


def stop_reason_of(finish_reason: str | None, matched, stop_sequences: list[str] | None):
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


class MessageStream:
    """One message's events, made from the chat path's chunks of one choice: `begin()`, then
    `feed(chunk)` for each, then `finish()`; `message` is the final Message object. Blocks
    open and close in turn: thinking (--reasoning-parser), text, tool_use."""

    def __init__(self, model: str, input_tokens: int, stop_sequences: list[str] | None) -> None:
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                        "model": model, "content": [], "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        self.stop_sequences = stop_sequences
        self.block: dict | None = None
        self.json = ""  # the open tool_use block's input, as streamed
        self.finish_reason = self.matched = None

    @property
    def content(self) -> list[dict]:
        return self.message["content"]

    def begin(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.message, "content": []}},
                {"type": "ping"}]

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.content.append(block)
        self.block = block
        return events + [{"type": "content_block_start", "index": len(self.content) - 1,
                          "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        block, self.block = self.block, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.json) if self.json.strip() else {}
            except ValueError:  # cut short by max_tokens: what was said is not an object
                block["input"] = {}
            self.json = ""
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.block is None or self.block["type"] != kind:
            events += self._open({"type": "text", "text": ""} if kind == "text" else
                                 {"type": "thinking", "thinking": "", "signature": ""})
        self.block[kind] += text
        delta = ({"type": "text_delta", "text": text} if kind == "text" else
                 {"type": "thinking_delta", "thinking": text})
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": delta}]

    def feed(self, chunk: dict) -> list[dict]:
        if not chunk["choices"]:
            usage = chunk.get("usage") or {}
            self.message["usage"]["output_tokens"] = usage.get("completion_tokens", 0)
            # the prompt as the engine ran it (an image's tokens counted once it was expanded)
            self.message["usage"]["input_tokens"] = usage.get(
                "prompt_tokens", self.message["usage"]["input_tokens"])
            return []
        choice = chunk["choices"][0]
        delta = choice["delta"]
        events: list[dict] = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                events += self._open({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                      "name": call["function"]["name"], "input": {}})
            fragment = call["function"].get("arguments", "")
            if fragment and self.block is not None and self.block["type"] == "tool_use":
                self.json += fragment
                events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                               "delta": {"type": "input_json_delta", "partial_json": fragment}})
        if choice["finish_reason"] is not None:
            self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def finish(self) -> list[dict]:
        events = self._close()
        reason, sequence = stop_reason_of(self.finish_reason, self.matched, self.stop_sequences)
        self.message["stop_reason"], self.message["stop_sequence"] = reason, sequence
        usage = self.message["usage"]
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": {"input_tokens": usage["input_tokens"],
                                    "output_tokens": usage["output_tokens"]}},
                         {"type": "message_stop"}]


def sse_event(event: dict) -> bytes:
    return (b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event)
            + b"\n\n")


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, raw: Request):
        self.chat.check_model(req.model)
        names: dict[str, str] = {}  # image parts on the chat path -> their blocks here
        chat_req = chat_request(req, self.chat.settings.tool_call_parser is not None, names)
        try:
            job = await self.chat.prepare(chat_req)
        except APIError as e:
            raise renamed(e, {**_PARAMS, **names}) from None
        job.include_usage = True
        stream = MessageStream(req.model, len(job.prompt_ids), req.stop_sequences)
        events = self.events(job, stream)
        if req.stream:
            return StreamingResponse(self.sse(events), media_type="text/event-stream")
        result = await until_disconnected(raw, self._collect(events, stream))
        return result if not isinstance(result, dict) else JSONResponse(result)

    async def events(self, job, stream: MessageStream) -> AsyncIterator[dict]:
        for event in stream.begin():
            yield event
        async for chunk in self.chat.chunks(job):
            for event in stream.feed(chunk):
                yield event
        for event in stream.finish():
            yield event

    @staticmethod
    async def _collect(events: AsyncIterator[dict], stream: MessageStream) -> dict:
        async for _ in events:
            pass
        return stream.message

    @staticmethod
    async def sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield sse_event(event)
        except STREAM_ERRORS as e:
            yield sse_event(anthropic_error_body(*as_anthropic(e)))

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        self.chat.check_model(req.model)
        names: dict[str, str] = {}
        chat_req = validated({"messages": chat_messages(req, names), **_tools_and_choice(req)})
        try:
            _, ids = await self.chat.render(chat_req.messages, True, tool_dicts(chat_req.tools))
        except APIError as e:
            raise renamed(e, names) from None
        return {"input_tokens": len(ids)}


def messages_router(chat: OpenAIServingChat) -> APIRouter:
    """The Messages API's routes; every error in Anthropic's shape."""
    router = APIRouter(route_class=AnthropicRoute)
    serving = AnthropicServingMessages(chat)

    @router.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw: Request):
        return await serving.create(req, raw)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return await serving.count_tokens(req)

    return router
