"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

A response is a chat completion underneath: its input items become chat messages (after the
stored conversation of `previous_response_id`, behind `instructions`), the chat path templates,
checks, constrains (`text.format`, a required or named `tool_choice`) and reads tool calls and
reasoning; `ResponseStream` turns its chunks into the Responses API's output items and events.
The non-streamed response is the same events' final state."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvflow.entrypoints.openai.errors import APIError, renamed, validation_message
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.responses_protocol import (MAX_ID_CHARS, FunctionCallItem,
                                                          FunctionCallOutputItem, MessageItem,
                                                          ResponsesRequest, input_items)
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat
from kvflow.entrypoints.openai.serving_engine import (STREAM_ERRORS, stream_error,
                                                      until_disconnected)

# the chat request's field -> the Responses API's name for it, in errors
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "structured_outputs": "text.format"}


def _hex(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(items: list, names: dict[str, str] | None = None,
                  offset: int = 0) -> list[dict]:
    """Input items as chat messages: function calls join the assistant turn they follow,
    their outputs are `tool` messages, earlier reasoning is left out. `names` maps each image
    part's name on the chat path (`messages[k].content[j]`, the messages starting at index
    `offset` there) to its input item's (`input[i].content[j]`)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = item.chat_content()
            if names is not None and isinstance(content, list):
                for j, part in enumerate(content):
                    if part["type"] == "image_url":
                        names[f"messages[{offset + len(messages)}].content[{j}]"] = \
                            f"input[{i}].content[{j}]"
            messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion that serves `req`."""
    body: dict = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                  "temperature": req.temperature, "top_p": req.top_p,
                  "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs.model_dump(by_alias=True,
                                                                       exclude_none=True)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise renamed(APIError(400, message, param, "invalid_value"), _PARAMS) from None


def usage_of(chat_usage: dict | None, reasoning_tokens: int) -> dict:
    u = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              u["completion_tokens"])},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


class ResponseStream:
    """One response's events, made from the chat path's chunks of one choice: `begin()`, then
    `feed(chunk)` for each, then `finish()`; `response` is the final Response object.
    Each output item is opened (`output_item.added`), streamed and closed (`.done`) in turn:
    reasoning, the message's text, function calls."""

    def __init__(self, response: dict, count_tokens=None) -> None:
        self.response = response
        self.seq = 0
        self.item: dict | None = None  # the open output item
        self.finish_reason: str | None = None
        self.chat_usage: dict | None = None
        self.count_tokens = count_tokens  # text -> tokens, for usage's reasoning_tokens
        self.reasoning_text = ""

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self) -> dict:
        return {**self.response, "output": [dict(i) for i in self.output]}

    def begin(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def _open(self, item: dict) -> list[dict]:
        events = self._close()
        self.output.append(item)
        self.item = item
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item={**item, "content": []} if "content" in item else dict(item)))
        if item["type"] in ("message", "reasoning"):
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      part=dict(item["content"][0])))
        return events

    def _close(self) -> list[dict]:
        item, self.item = self.item, None
        if item is None:
            return []
        at = len(self.output) - 1
        item["status"] = "completed"
        events = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            events.append(self._event(f"response.{kind}.done", item_id=item["id"],
                                      output_index=at, content_index=0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=at, content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=at, name=item["name"],
                                      arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=at,
                                  item={**item, "content": [dict(p) for p in item["content"]]}
                                  if "content" in item else dict(item)))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.item is None or self.item["type"] != kind:
            if kind == "message":
                item = {"id": _hex("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress",
                        "content": [{"type": "output_text", "text": "", "annotations": [],
                                     "logprobs": []}]}
            else:
                item = {"id": _hex("rs"), "type": "reasoning", "summary": [],
                        "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}
            events += self._open(item)
        self.item["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        name = "output_text" if kind == "message" else "reasoning_text"
        events.append(self._event(f"response.{name}.delta", item_id=self.item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=text, **extra))
        return events

    def feed(self, chunk: dict) -> list[dict]:
        if not chunk["choices"]:
            self.chat_usage = chunk.get("usage")
            return []
        choice = chunk["choices"][0]
        delta = choice["delta"]
        events: list[dict] = []
        if delta.get("reasoning_content"):
            self.reasoning_text += delta["reasoning_content"]
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call begins
                events += self._open({"id": _hex("fc"), "type": "function_call",
                                      "status": "in_progress", "call_id": call["id"],
                                      "name": call["function"]["name"], "arguments": ""})
            fragment = call["function"].get("arguments", "")
            if fragment and self.item is not None and self.item["type"] == "function_call":
                self.item["arguments"] += fragment
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self.item["id"],
                                          output_index=len(self.output) - 1, delta=fragment))
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict]:
        events = []
        if not self.output:  # nothing was said: still one (empty) message
            events += self._text("message", "")[:-1]
        events += self._close()
        r = self.response
        reasoning = self.count_tokens(self.reasoning_text) if self.reasoning_text and \
            self.count_tokens else 0
        r["usage"] = usage_of(self.chat_usage, reasoning)
        r["completed_at"] = int(time.time())
        if self.finish_reason == "length":
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self._snapshot()))
        else:
            r["status"] = "completed"
            events.append(self._event("response.completed", response=self._snapshot()))
        return events

    def history_message(self) -> dict:
        """This response's output as the assistant's chat message, for a later turn."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def listed_items(raw: str | list[dict], items: list) -> list[dict]:
    """This turn's input items as `input_items` lists them: as given, each with an id."""
    if isinstance(raw, str):
        return [{"id": _hex("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    out = []
    for given, item in zip(raw, items):
        listed = {"type": item.type, **given}
        if not isinstance(listed.get("id"), str):
            listed["id"] = _hex(_ITEM_PREFIX[item.type])
        if item.type == "message" and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            listed["content"] = [{"type": kind, "text": item.content}]
        out.append(listed)
    return out


def response_skeleton(req: ResponsesRequest, model: str) -> dict:
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {
        "id": _hex("resp"), "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                 else {"type": "text"}},
        "tool_choice": "auto" if choice is None else
        (choice if isinstance(choice, str) else choice.model_dump()),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "usage": None, "user": req.user, "metadata": req.metadata or {}}


def sse_event(event: dict) -> bytes:
    return (b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event)
            + b"\n\n")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create(self, req: ResponsesRequest, raw: Request):
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous_response_id: no stored response "
                                    f"{req.previous_response_id!r} (responses created with "
                                    "store: false are not kept, nor are deleted or evicted "
                                    "ones)", param="previous_response_id", code="not_found")
            history = previous.history
        items = input_items(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        names: dict[str, str] = {}  # image parts on the chat path -> their input items
        turn = chat_messages(items, names, len(system) + len(history))
        try:
            job = await self.chat.prepare(chat_request(req, system + history + turn))
        except APIError as e:
            raise renamed(e, {**_PARAMS, **names}) from None
        job.include_usage = True
        stream = ResponseStream(response_skeleton(req, job.model), self._count_tokens)
        stored = (history + turn, listed_items(req.input, items)) if req.store else None
        events = self.events(job, stream, stored)
        if req.stream:
            return StreamingResponse(self.sse(events, stream), media_type="text/event-stream")
        result = await until_disconnected(raw, self._collect(events, stream))
        return result if not isinstance(result, dict) else JSONResponse(result)

    def _count_tokens(self, text: str) -> int:
        return len(self.chat.tokenizer.encode(text, add_special_tokens=False))

    async def events(self, job, stream: ResponseStream,
                     stored: tuple[list[dict], list[dict]] | None) -> AsyncIterator[dict]:
        """The response's events; once it is complete, it is stored (unless `store: false`)
        with the conversation so far (`stored`: its messages and this turn's input items)."""
        for event in stream.begin():
            yield event
        async for chunk in self.chat.chunks(job):
            for event in stream.feed(chunk):
                yield event
        for event in stream.finish():
            yield event
        if stored is not None:
            history, items = stored
            self.store.put(stream.response, history + [stream.history_message()], items)

    @staticmethod
    async def _collect(events: AsyncIterator[dict], stream: ResponseStream) -> dict:
        async for _ in events:
            pass
        return stream.response

    @staticmethod
    async def sse(events: AsyncIterator[dict], stream: ResponseStream) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield sse_event(event)
        except STREAM_ERRORS as e:
            err = stream_error(e)["error"]
            yield sse_event({"type": "error", "code": err["code"], "message": err["message"],
                             "param": err["param"], "sequence_number": stream.seq})

    def get(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id",
                           code="not_found")
        return entry.response

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict:
        """`GET /v1/responses/{id}/input_items`: this response's input, a page at a time."""
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id",
                           code="not_found")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise APIError(400, f"after: no input item {after!r} in this response",
                               param="after", code="invalid_value")
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise APIError(404, f"no stored response {response_id!r}", param="response_id",
                           code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}


def responses_router(chat: OpenAIServingChat) -> APIRouter:
    """The Responses API's routes (errors in OpenAI's shape, as the rest of /v1)."""
    router = APIRouter()
    serving = OpenAIServingResponses(chat)

    @router.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await serving.create(req, raw)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return serving.get(response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc",
                               after: str | None = Query(None, max_length=MAX_ID_CHARS)):
        return serving.input_items(response_id, limit, order, after)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return serving.delete(response_id)

    return router
