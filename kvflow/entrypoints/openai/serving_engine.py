"""What completions and chat share: settings, request checks, stream plumbing."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from fastapi import Request
from fastapi.responses import Response

from kvflow.engine.async_engine import AsyncLLM
from kvflow.engine.core_client import EngineDeadError
from kvflow.entrypoints.openai.errors import APIError, bad_request, error_body
from kvflow.entrypoints.openai.server_settings import ServerSettings
from kvflow.entrypoints.openai.serving_lora import LoRAAdapters
from kvflow.multimodal.inputs import MultiModalData
from kvflow.multimodal.media import MediaConnector
from kvflow.multimodal.parts import ImageRef
from kvflow.request import InvalidRequestError
from kvflow.sampling_params import SamplingParams

# What one request may ask for, checked before any work is done for it (vLLM caps none of
# these; OpenAI documents none for completions). The body itself is capped by --max-body-size.
MAX_CHOICES = 4096  # prompts x n: each choice is a sequence in the engine
MAX_REQUEST_TOKENS = 2**20  # prompt tokens x n, summed over the request's prompts
MAX_MESSAGES = 4096  # messages of one chat
# A text longer than this many characters per token of max_model_len cannot fit in any
# tokenizer we know of, and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 64
# Texts up to this size are tokenized on the event loop (microseconds); larger ones on the
# tokenizer thread, so that one big prompt never stalls every other stream and /health.
INLINE_TOKENIZE_CHARS = 8192

_tokenizer_thread: ThreadPoolExecutor | None = None


async def off_loop(work: Callable, *args, size: int, **kwargs):
    """`work(*args, **kwargs)` inline when `size` (characters) is small, else on the one
    tokenizer thread (one thread: the tokenizer is never used by two threads at once)."""
    global _tokenizer_thread
    if size <= INLINE_TOKENIZE_CHARS:
        return work(*args, **kwargs)
    if _tokenizer_thread is None:
        _tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvflow-tokenize")
    return await asyncio.get_running_loop().run_in_executor(
        _tokenizer_thread, functools.partial(work, *args, **kwargs))


class ShuttingDownError(RuntimeError):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings,
                 loras: LoRAAdapters | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.loras = loras if loras is not None else LoRAAdapters(
            settings.lora_modules, settings.served_model_names, settings.lora_allowed_root)
        self.media = MediaConnector.of(engine.config.multimodal_config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, model: str | None):
        """The LoRARequest of the adapter `model` names (None: the base model); 404 otherwise."""
        return self.loras.resolve(model)

    def check_available(self, num_new: int) -> None:
        """503 while shutting down, once the engine died, or past --max-waiting-requests."""
        if self.settings.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.is_dead:
            raise APIError(503, f"the engine is not running: {self.engine.dead_error}",
                           code=self.engine.dead_error.code)
        limit = self.settings.max_waiting_requests
        if limit is not None:
            waiting = self.engine.num_waiting_after(num_new)
            if waiting > limit:
                raise APIError(503, f"the server is busy: {waiting} requests would be waiting "
                                    f"(max_waiting_requests is {limit}); retry in a moment",
                               code="server_busy", headers={"Retry-After": "1"})

    @property
    def input_processor(self):
        """The engine's one request check; the methods below run its stages and turn its
        ValueErrors into 400s naming the field."""
        return self.engine.input_processor

    def make_params(self, req, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, lora_request=None) -> SamplingParams:
        """The request's SamplingParams, checked by the input processor (every id and top_k
        against the vocabulary, prompt logprobs, the adapter) before anything is tokenized."""
        try:
            params = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
            self.input_processor.check_params(params, lora_request)
        except ValueError as e:
            raise refused(e) from None
        return params

    async def check_constraint(self, params: SamplingParams) -> None:
        """A constraint the grammar backend cannot enforce (a bad schema, grammar or regex) is
        a 400 naming the problem, before the request reaches the engine. A big schema is
        checked off the loop."""
        so = params.structured_outputs
        if so is None:
            return
        size = sum(len(t) for t in (so.json, so.regex, so.grammar, *(so.choice or ())) if t)
        try:
            await off_loop(self.input_processor.check_constraint, params, size=size)
        except ValueError as e:
            raise bad_request(e) from None

    @staticmethod
    def check_choices(num_prompts: int, n: int) -> None:
        """Each prompt x n is one sequence in the engine: cap them before any tokenizing."""
        if num_prompts * n > MAX_CHOICES:
            raise APIError(400, f"{'n' if n > 1 else 'prompt'}: {num_prompts} prompts x n={n} is "
                                f"{num_prompts * n} choices; at most {MAX_CHOICES} per request",
                           param="n" if n > 1 else "prompt", code="too_many_choices")

    def check_text_size(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit in max_model_len before spending time tokenizing it."""
        limit = self.engine.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > limit:
            raise APIError(400, f"{param}: {chars} characters cannot fit in max_model_len "
                                f"{self.engine.max_model_len} (at most {limit} characters)",
                           param=param, code="invalid_value")

    @staticmethod
    def check_request_tokens(num_prompt_tokens: int, n: int) -> None:
        total = num_prompt_tokens * n
        if total > MAX_REQUEST_TOKENS:
            raise APIError(400, f"prompt: {num_prompt_tokens} prompt tokens x n={n} is {total} "
                                f"tokens; at most {MAX_REQUEST_TOKENS} per request",
                           param="prompt", code="too_many_tokens")

    def check_prompt(self, ids: list[int], params: SamplingParams,
                     multi_modal_data: MultiModalData | None = None,
                     image_names: list[str] | None = None) -> None:
        """The input processor's prompt check (ids, images, length, KV pool), as a 400."""
        try:
            self.input_processor.check_prompt(ids, params, multi_modal_data, image_names)
        except ValueError as e:
            raise refused(e) from None

    def check_multi_modal(self, multi_modal_data: MultiModalData | None,
                          image_names: list[str] | None) -> None:
        """The input processor's image check (the model takes them, their count), as a 400."""
        try:
            self.input_processor.check_multi_modal(multi_modal_data, image_names)
        except ValueError as e:
            raise refused(e) from None

    async def load_images(self, refs: list[ImageRef]
                          ) -> tuple[MultiModalData | None, list[str] | None]:
        """The request's images, counted before any is read, then each read and bounded
        (kvflow/multimodal/media.py) off the event loop, one at a time; a 400 naming the
        part. Whether the model takes images at all is `check_multi_modal`'s, after these
        checks, so that a hostile part is named as such on any model."""
        if not refs:
            return None, None
        names = [r.where for r in refs]
        try:
            self.input_processor.check_image_count(names)
            items = [await asyncio.to_thread(self.media.load_url, r.url, r.where) for r in refs]
        except ValueError as e:
            raise refused(e) from None
        return {"image": items}, names


def refused(e: ValueError) -> APIError:
    """The 400 for an input processor's refusal: the field it names (InvalidRequestError's
    `param`), else the one its message starts with."""
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param, code="invalid_value")
    return bad_request(e)


async def merge_streams(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (index, item). Closing the merged stream cancels
    (and so aborts) the ones still running."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_error(e: BaseException) -> dict:
    """The error object sent inside a stream that has already begun."""
    if isinstance(e, APIError):
        return error_body(e.status, e.message, e.param, e.code)
    if isinstance(e, ValueError):
        err = bad_request(e)
        return error_body(400, err.message, err.param, err.code)
    if isinstance(e, ShuttingDownError):
        return error_body(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return error_body(503, f"the engine is not running: {e}", code=e.code)
    return error_body(500, f"internal server error: {type(e).__name__}: {e}", code="internal_error")


STREAM_ERRORS = (APIError, ValueError, EngineDeadError, ShuttingDownError)


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events: `data: {chunk}` lines, an error object if the stream fails, `[DONE]`."""
    try:
        async for chunk in chunks:
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    except STREAM_ERRORS as e:
        yield b"data: " + msgspec.json.encode(stream_error(e)) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def until_disconnected(raw: Request, coro) -> object:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the
    client goes away first."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody is listening


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """OpenAI's usage object; `prompt_tokens_details` only when `cached_tokens` is given
    (--enable-prompt-tokens-details), as in vLLM."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
