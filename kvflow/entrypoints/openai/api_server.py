"""The OpenAI-compatible HTTP + WebSocket server: FastAPI app, gatekeeping, uvicorn runner."""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import signal
import socket
import time

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

import kvflow
from kvflow import envs
from kvflow.config import EngineConfig
from kvflow.engine.async_engine import AsyncLLM
from kvflow.engine.core_client import EngineDeadError, EngineStartupError
from kvflow.engine.dp_engine import DPAsyncLLM
from kvflow.engine.kv_sizing import max_concurrency
from kvflow.entrypoints.anthropic.errors import anthropic_error_response
from kvflow.entrypoints.anthropic.serving_messages import messages_router
from kvflow.entrypoints.openai.dashboard import DASHBOARD_PATHS, dashboard_router
from kvflow.entrypoints.openai.errors import error_response, install_error_handlers
from kvflow.entrypoints.openai.metrics import ServerMetrics
from kvflow.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest)
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat, tool_dicts
from kvflow.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvflow.entrypoints.openai.serving_responses import responses_router
from kvflow.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from kvflow.entrypoints.openai.server_settings import ServerSettings
from kvflow.entrypoints.openai.serving_engine import MAX_REQUEST_TOKENS, ShuttingDownError, off_loop
from kvflow.entrypoints.openai.serving_lora import (LoadLoRAAdapterRequest, LoRAAdapters,
                                                   UnloadLoRAAdapterRequest)
from kvflow.entrypoints.openai.serving_ws import WebSocketSession
from kvflow.sampling_params import check_token_ids

# no API key needed
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", *DASHBOARD_PATHS})
ENGINE_DEATH_GRACE_S = 3.0  # time for in-flight clients to read their error before exit
WS_AUTH_PENDING = "kvflow.ws_auth_pending"  # scope key: the key must come in the first message
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's API: its clients read its own error shape


class RedactSecrets(logging.Filter):
    """Keeps credentials out of uvicorn's lines: a `?api_key=` (or `key=`, `token=`) in a
    logged URL is replaced, whatever the client sent. kvflow never accepts a key in the URL."""

    _PATTERN = re.compile(r"(?i)\b((?:api_?key|key|token|access_token)=)[^&\s\"']*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(self._PATTERN.sub(r"\1REDACTED", a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self._PATTERN.sub(r"\1REDACTED", record.msg)
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


def gate_error(path: str, status: int, message: str, code: str) -> Response:
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_response(status, message)
    return error_response(status, message, code=code)


class Gate:
    """ASGI middleware in front of every route: 503 while shutting down, the API key
    (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`), and the request body size
    limit (413)."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        refuse = functools.partial(gate_error, path)
        if path not in OPEN_PATHS:
            if kind == "http" and self.settings.shutting_down:
                return await refuse(503, "the server is shutting down",
                                    code="shutting_down")(scope, receive, send)
            if self.settings.api_key and not self._authorized(scope):
                if kind == "websocket" and path == "/v1/ws":
                    # Browsers cannot set headers on a WebSocket: the key may come as the
                    # first message instead (never in the URL, which servers log).
                    scope[WS_AUTH_PENDING] = True
                    return await self.app(scope, receive, send)
                return await refuse(401, "invalid or missing API key (expected "
                                         "'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                    code="invalid_api_key")(scope, receive, send)
        if kind == "http":
            length = dict(scope["headers"]).get(b"content-length")
            limit = self.settings.max_body_size
            if length is not None and length.isdigit() and int(length) > limit:
                return await refuse(413, f"request body of {int(length)} bytes is over the "
                                         f"limit of {limit} bytes",
                                    code="request_too_large")(scope, receive, send)
            if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffered(receive, limit, scope, send, refuse)
                if receive is None:
                    return
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:] if given[:7].lower() == "bearer " else None
        if token is None and b"x-api-key" in headers:
            token = headers[b"x-api-key"].decode("latin-1")
        return token is not None and hmac.compare_digest(token.encode(), self.settings.api_key.encode())

    @staticmethod
    async def _buffered(receive, limit: int, scope, send, refuse):
        """Read a body of unknown length (chunked) up to the limit, then replay it."""
        body, more = [], True
        size = 0
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return receive
            body.append(msg.get("body", b""))
            size += len(body[-1])
            more = msg.get("more_body", False)
            if size > limit:
                await refuse(413, f"request body is over the limit of {limit} bytes",
                             code="request_too_large")(scope, receive, send)
                return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()
        return replay


def build_app(engine: AsyncLLM | DPAsyncLLM, settings: ServerSettings,
              metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="kvflow", version=kvflow.__version__)
    install_error_handlers(app)
    loras = LoRAAdapters(settings.lora_modules, settings.served_model_names,
                         settings.lora_allowed_root)
    completions = OpenAIServingCompletion(engine, settings, loras)
    chat = OpenAIServingChat(engine, settings, loras)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, f"the engine is not running: {exc}", code=exc.code)

    @app.exception_handler(ShuttingDownError)
    async def _stopping(request: Request, exc: ShuttingDownError):
        return error_response(503, str(exc), code="shutting_down")

    @app.get("/health")
    async def health():
        if engine.is_dead:
            return error_response(503, f"the engine is not running: {engine.dead_error}",
                                  code=engine.dead_error.code)
        if settings.shutting_down:
            return error_response(503, "the server is shutting down", code="shutting_down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvflow.__version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if engine.is_dead:
            return error_response(503, f"the engine is not running: {engine.dead_error}",
                                  code=engine.dead_error.code)
        if not await engine.reset_prefix_cache():
            return error_response(409, "the prefix cache cannot be reset while requests are "
                                       "running; retry when the server is idle",
                                  code="requests_running")
        return Response(status_code=200)

    started = int(time.time())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "kvflow",
             "root": engine.model_path, "max_model_len": engine.max_model_len}
            for name in settings.served_model_names] + loras.model_cards(started)}

    if envs.KVFLOW_ALLOW_RUNTIME_LORA_UPDATING:  # vLLM's endpoints, off unless asked for
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            return Response(await loras.load(engine, req), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            return Response(await loras.unload(engine, req), media_type="text/plain")

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await chat.create(req, raw)

    embeddings = OpenAIServingEmbedding(engine, settings, loras)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embeddings.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        completions.check_model(req.model)
        if req.messages is not None:
            # images counted as the engine runs them: each expanded to its tokens (vLLM's count)
            ids = (await chat.render(req.messages, req.add_generation_prompt,
                                     tool_dicts(req.tools), req.chat_template_kwargs)).prompt_ids
        elif req.prompt is not None:
            completions.check_text_size(len(req.prompt), "prompt")
            ids = await off_loop(engine.tokenizer.encode, req.prompt,
                                 add_special_tokens=req.add_special_tokens, size=len(req.prompt))
        else:
            return error_response(400, "give either prompt or messages", "prompt", "invalid_value")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        completions.check_model(req.model)
        if len(req.tokens) > MAX_REQUEST_TOKENS:
            return error_response(400, f"tokens: {len(req.tokens)} tokens; at most "
                                       f"{MAX_REQUEST_TOKENS}", "tokens", "invalid_value")
        try:
            check_token_ids("tokens", req.tokens, engine.info.vocab_size)
        except ValueError as e:
            return error_response(400, str(e), "tokens", "invalid_value")
        # a token is a few characters: decode big lists on the tokenizer thread
        text = await off_loop(engine.tokenizer.decode, req.tokens, size=4 * len(req.tokens))
        return {"prompt": text}

    @app.websocket("/v1/ws")
    async def websocket(ws: WebSocket):
        if settings.shutting_down or engine.is_dead:
            await ws.close(code=1013)  # try again later
            return
        key = settings.api_key if ws.scope.get(WS_AUTH_PENDING) else None
        await WebSocketSession(ws, completions, chat, api_key=key).run()

    app.include_router(responses_router(chat))
    app.include_router(messages_router(chat))
    app.include_router(dashboard_router(engine, metrics.recent, settings))
    app.add_middleware(Gate, settings=settings)
    return app


class _Server(uvicorn.Server):
    """uvicorn, but a signal also ends in-flight streams at once (instead of waiting for them)
    and the process exits normally afterwards, so that the engine process is stopped too."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        self._on_exit()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a busy port fails in a second, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


async def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Start the engine process, serve until a signal (or the engine dies), stop both."""
    sock = bind_socket(settings.host, settings.port)
    dp = config.parallel_config.data_parallel_size
    metrics = ServerMetrics(settings.model_name, dp)
    install_log_redaction()
    try:
        if dp > 1:
            engine = DPAsyncLLM(config, [metrics.for_engine(i) for i in range(dp)],
                                stall_timeout=settings.engine_stall_timeout,
                                policy=settings.load_balance_method)
        else:
            engine = AsyncLLM(config, metrics.for_engine(0),
                              stall_timeout=settings.engine_stall_timeout)
        info = await engine.start()
    except (EngineStartupError, ValueError, RuntimeError) as e:
        sock.close()
        print(f"kvflow serve: could not start the engine: {e}", flush=True)
        return 1
    metrics.set_total_blocks(info.num_blocks)
    loop = asyncio.get_running_loop()
    app = build_app(engine, settings, metrics)
    uv_config = uvicorn.Config(app, lifespan="off", access_log=settings.access_log, log_level="info",
                               timeout_graceful_shutdown=5)
    stopping = False

    def begin_shutdown() -> None:
        nonlocal stopping
        settings.shutting_down = True
        if not stopping:
            stopping = True
            engine.abort_all(ShuttingDownError("the server is shutting down"))

    server = _Server(uv_config, lambda: loop.call_soon_threadsafe(begin_shutdown))

    def on_engine_dead(error: EngineDeadError) -> None:
        print(f"kvflow serve: {error}; shutting down in {ENGINE_DEATH_GRACE_S:.0f}s", flush=True)
        loop.call_later(ENGINE_DEATH_GRACE_S, lambda: setattr(server, "should_exit", True))

    engine.on_dead = on_engine_dead
    tokens = info.num_blocks * info.block_size
    host = settings.host
    shown_host = f"[{host}]" if ":" in host else host
    print(f"kvflow serve: http://{shown_host}:{settings.port}/v1  model {settings.model_name!r} "
          f"({engine.model_path})\n"
          f"  KV cache: {info.num_blocks} blocks x {info.block_size} = {tokens} tokens; "
          f"max_model_len {info.max_model_len}; max concurrency at max_model_len "
          f"{max_concurrency(info.num_blocks, info.block_size, info.max_model_len):.2f}; "
          f"max_num_seqs {info.max_num_seqs}\n"
          + (f"  engine core pid {info.pid}" if dp == 1 else
             f"  data parallel: {dp} engine cores (pids "
             f"{', '.join(str(i.pid) for i in engine.infos)}), requests by "
             f"{settings.load_balance_method}; the KV cache above is each one's"), flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        settings.shutting_down = True
        await engine.shutdown()
        sock.close()
    return 1 if engine.is_dead else 0
