"""Where each of `kvflow serve`'s endpoints goes behind `kvflow router`.

- completions, chat, Anthropic's messages, embeddings: one worker, by the routing policy (in
  prefill/decode mode completions and chat are disaggregated, embeddings, which are a prompt
  only, go to a prefill instance, and messages and responses are refused: the prefill hop
  hands `kv_transfer_params` over on the OpenAI completions and chat endpoints only);
- the Responses API: a new response by the policy; one that continues a `previous_response_id`,
  and GET / DELETE of a stored response, to the replica that stored it (each replica keeps its
  own store). The router remembers response id -> replica for the last MAX_RESPONSE_HOMES
  responses it relayed; an id it does not know (older, or before a restart of the router) is
  looked for on every replica;
- tokenize, detokenize, count_tokens: any one worker (all have the same tokenizer);
- LoRA load and unload: every worker, since any may be chosen for a request naming the adapter.
  Success only if every worker succeeded; a load that some refused is undone where it was done,
  so that the workers stay alike."""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from urllib.parse import quote

import httpx
from fastapi.responses import JSONResponse, Response

ANTHROPIC_PREFIX = "/v1/messages"  # its clients read Anthropic's error shape
RESPONSES = "/v1/responses"
NOT_IN_PD = ("/v1/responses", "/v1/messages")
ANY_WORKER = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
FAN_OUT = (LOAD_LORA, UNLOAD_LORA)
# opening events of the Responses and Messages streams: they carry no token yet, so the stream
# may still be retried on another replica after them
PREAMBLE_EVENTS = frozenset({"response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added",
                             "message_start", "content_block_start", "ping"})
MAX_RESPONSE_HOMES = 65536
MAX_RESPONSE_ID_CHARS = 256  # the servers' limit on previous_response_id
MAX_SCAN_BYTES = 2**20  # of a stream, looking for its response id
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}


def error(status: int, message: str, param: str | None = None, path: str = "") -> JSONResponse:
    """The router's own error, in OpenAI's shape, or Anthropic's on its Messages API."""
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse({"type": "error", "error": {
            "type": ANTHROPIC_TYPES.get(status, "api_error"),
            "message": message if not param or message.startswith(param)
            else f"{param}: {message}"}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": param,
                                   "code": status}}, status_code=status)


def check_response_id(value: object, param: str) -> str:
    """A response id from the client, or ValueError naming `param`."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_RESPONSE_ID_CHARS \
            or not value.isprintable():
        raise ValueError(f"{param}: a response id is 1 to {MAX_RESPONSE_ID_CHARS} printable "
                         "characters")
    return value


def stored_path(response_id: str, suffix: str = "") -> str:
    return f"{RESPONSES}/{quote(response_id, safe='')}{suffix}"


class ResponseHomes:
    """response id -> URL of the replica that stored it; least recently used out past
    `max_items` (such an id is then looked for on every replica)."""

    def __init__(self, max_items: int = MAX_RESPONSE_HOMES) -> None:
        self.max_items = max_items
        self._urls: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._urls)

    def get(self, response_id: str) -> str | None:
        url = self._urls.get(response_id)
        if url is not None:
            self._urls.move_to_end(response_id)
        return url

    def put(self, response_id: str, url: str) -> None:
        self._urls[response_id] = url
        self._urls.move_to_end(response_id)
        while len(self._urls) > self.max_items:
            self._urls.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._urls.pop(response_id, None)


def response_id_in(event: bytes) -> str | None:
    """The response id one Responses stream event carries (`response.created` is the first)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                obj = json.loads(line[5:])
            except ValueError:
                return None
            r = obj.get("response") if isinstance(obj, dict) else None
            rid = r.get("id") if isinstance(r, dict) else None
            return rid if isinstance(rid, str) else None
    return None


class ResponseIdScan:
    """Reads a relayed Responses stream until its response id shows, then calls `found` once."""

    def __init__(self, found) -> None:
        self.found = found
        self.buf = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self.buf += chunk
        while (end := self.buf.find(b"\n\n")) >= 0:
            event, self.buf = self.buf[:end], self.buf[end + 2:]
            rid = response_id_in(event)
            if rid is not None:
                self.done, self.buf = True, b""
                self.found(rid)
                return
        if len(self.buf) > MAX_SCAN_BYTES:
            self.done, self.buf = True, b""


def _reason(resp: httpx.Response) -> str:
    """What a worker said when it refused: its error's message, or its text."""
    try:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        if isinstance(msg, str):
            return msg[:300]
    except ValueError:
        pass
    return resp.text[:300]


class FanOut:
    """One request to every worker (LoRA load and unload)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def _call(self, url: str, path: str, body: dict, headers: dict):
        try:
            return await self.client.post(url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            return e

    async def send(self, urls: list[str], path: str, body: dict, headers: dict) -> Response:
        if not urls:
            return error(503, f"router: no worker to send {path} to")
        results = await asyncio.gather(*(self._call(u, path, body, headers) for u in urls))
        failed = [(u, r) for u, r in zip(urls, results)
                  if not isinstance(r, httpx.Response) or r.status_code != 200]
        if not failed:
            first = results[0]
            return Response(first.content, status_code=200,
                            media_type=first.headers.get("content-type", "text/plain"))
        done = [u for u, r in zip(urls, results)
                if isinstance(r, httpx.Response) and r.status_code == 200]
        undone = ""
        if path == LOAD_LORA and done:  # the workers stay alike: none keeps it
            name = {"lora_name": body.get("lora_name")}
            await asyncio.gather(*(self._call(u, UNLOAD_LORA, name, headers) for u in done))
            undone = f"; unloaded again from the {len(done)} that loaded it"
        statuses = {r.status_code if isinstance(r, httpx.Response) else 502 for _, r in failed}
        status = statuses.pop() if len(statuses) == 1 else 502
        params = {(r.json().get("error") or {}).get("param") for _, r in failed
                  if isinstance(r, httpx.Response) and _is_json_object(r)}
        param = params.pop() if len(params) == 1 else None
        said = "; ".join(f"{u}: " + (f"{r.status_code} {_reason(r)}" if isinstance(r, httpx.Response)
                                     else f"unreachable ({type(r).__name__})") for u, r in failed)
        return error(status, f"router: {path} failed on {len(failed)} of {len(urls)} workers: "
                             f"{said}{undone}", param if isinstance(param, str) else None)


def _is_json_object(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)
