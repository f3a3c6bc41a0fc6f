"""WebSocket /v1/ws: many streamed requests over one socket.

Client -> server (JSON text):
    {"type": "auth", "api_key": "KEY"}                              first, when the server has
                                                                    an API key and the
                                                                    connection carried no
                                                                    'Authorization: Bearer KEY'
    {"id": "a", "type": "completion", "prompt": "...", ...}        any /v1/completions fields
    {"id": "b", "type": "chat", "messages": [...], ...}            any /v1/chat/completions fields
    {"id": "a", "type": "cancel"}                                   abort request "a"
`type` may be left out: a request with `messages` is a chat, else a completion.

Server -> client (JSON text), per request id:
    {"type": "chunk", "id": "a", "data": {...}}     the same chunk an SSE stream carries
    {"type": "done", "id": "a"}                     after the last chunk
    {"type": "cancelled", "id": "a"}                after a cancel
    {"type": "error", "id": "a", "error": {...}}    OpenAI-shaped error; the request is over

A bad message (not JSON, nested too deeply, an invalid id, too many requests in flight on the
socket) is answered with an error frame; it never ends the connection or other requests.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging

import msgspec
from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from kvflow.entrypoints.openai.errors import APIError, error_body, validation_message
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat
from kvflow.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvflow.entrypoints.openai.serving_engine import STREAM_ERRORS, stream_error
from kvflow.sampling_params import find_lone_surrogate

logger = logging.getLogger("kvflow")

MAX_REQUESTS_PER_SOCKET = 256  # request ids in flight at once on one connection
MAX_ID_CHARS = 256

AUTH_TIMEOUT_S = 10.0  # for the first message of a connection that must authenticate


class WebSocketSession:
    """One connection: a reader loop plus one task per request."""

    def __init__(self, ws: WebSocket, completions: OpenAIServingCompletion,
                 chat: OpenAIServingChat, api_key: str | None = None) -> None:
        self.ws = ws
        self.api_key = api_key  # set: the first message must be {"type": "auth", "api_key": KEY}
        self.completions, self.chat = completions, chat
        self.tasks: dict[str, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()

    async def send(self, obj: dict) -> None:
        async with self._send_lock:
            await self.ws.send_text(msgspec.json.encode(obj).decode())

    async def run(self) -> None:
        await self.ws.accept()
        if self.api_key is not None and not await self.authenticate():
            try:
                await self.ws.close(code=1008)  # policy violation, as for a bad header
            except RuntimeError:
                pass  # already gone
            return
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is None:  # a binary frame: JSON in UTF-8 is accepted too
                    try:
                        text = (msg.get("bytes") or b"").decode("utf-8")
                    except UnicodeDecodeError:
                        await self.send({"type": "error", "id": None,
                                         **error_body(400, "message is not valid UTF-8")})
                        continue
                await self.handle(text)
        except WebSocketDisconnect:
            pass
        finally:
            for task in self.tasks.values():
                task.cancel()  # aborts each request in the engine
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def authenticate(self) -> bool:
        """The first message carries the key (never logged, never echoed)."""
        try:
            text = await asyncio.wait_for(self.ws.receive_text(), AUTH_TIMEOUT_S)
            msg = json.loads(text)
        except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError, KeyError,
                json.JSONDecodeError, RecursionError):
            return False
        key = msg.get("api_key") if isinstance(msg, dict) and msg.get("type") == "auth" else None
        return isinstance(key, str) and hmac.compare_digest(key.encode("utf-8", "surrogatepass"),
                                                       self.api_key.encode())

    async def handle(self, text: str) -> None:
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else f"not valid JSON: {e}"
            await self.send({"type": "error", "id": None, **error_body(400, f"message is {why}")})
            return
        if not isinstance(msg, dict):
            await self.send({"type": "error", "id": None, **error_body(400, "message must be a JSON object")})
            return
        rid, kind = msg.get("id"), msg.get("type")
        if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS \
                or find_lone_surrogate(rid) is not None:
            await self.send({"type": "error", "id": rid if isinstance(rid, (int, float)) else None,
                             **error_body(400, f"id: each request needs a string id of 1 to "
                                               f"{MAX_ID_CHARS} characters of valid Unicode", "id")})
            return
        if kind == "cancel":
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await self.send({"type": "cancelled", "id": rid})
            return
        if rid in self.tasks:
            await self.send({"type": "error", "id": rid,
                             **error_body(400, f"id: request {rid!r} is still running", "id")})
            return
        if len(self.tasks) >= MAX_REQUESTS_PER_SOCKET:
            await self.send({"type": "error", "id": rid, **error_body(
                429, f"id: {len(self.tasks)} requests are in flight on this connection; at most "
                     f"{MAX_REQUESTS_PER_SOCKET}", "id", "too_many_requests")})
            return
        if kind is None:
            kind = "chat" if "messages" in msg else "completion"
        if kind not in ("chat", "completion"):
            await self.send({"type": "error", "id": rid, **error_body(
                400, "type must be completion, chat or cancel, got "
                     + (repr(kind[:64]) if isinstance(kind, str) else type(kind).__name__), "type")})
            return
        self.tasks[rid] = asyncio.create_task(self.serve(rid, kind, msg))

    async def serve(self, rid: str, kind: str, body: dict) -> None:
        serving = self.chat if kind == "chat" else self.completions
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            try:
                req = model.model_validate(body)
            except ValidationError as e:
                message, param = validation_message(e.errors())
                raise APIError(400, message, param=param, code="invalid_value") from None
            job = await serving.prepare(req)
            async for chunk in serving.chunks(job):
                await self.send({"type": "chunk", "id": rid, "data": chunk})
            await self.send({"type": "done", "id": rid})
        except STREAM_ERRORS as e:
            await self._send_quietly({"type": "error", "id": rid, **stream_error(e)})
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the socket is gone; run() cleans up
        except Exception as e:  # noqa: BLE001 - a bug must end this request, not the socket
            logger.exception("websocket request %r failed", rid)
            await self._send_quietly({"type": "error", "id": rid, **stream_error(e)})
        finally:
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]

    async def _send_quietly(self, obj: dict) -> None:
        try:
            await self.send(obj)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
