"""POST /v1/chat/completions: messages through the model's chat template, deltas out."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.entrypoints.openai.errors import APIError, bad_request
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kvflow.entrypoints.openai.serving_engine import (MAX_MESSAGES, OpenAIServing, off_loop, sse,
                                                      until_disconnected, usage_info)
from kvflow.outputs import Logprob
from kvflow.sampling_params import SamplingParams


@dataclass
class ChatJob:
    request_id: str
    created: int
    model: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int
    include_usage: bool
    priority: int = 0
    cache_salt: str | None = None


def _entry(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
    """`choices[].logprobs` of the chat API: one entry per token with its top-N alternatives."""
    content = []
    for tok, d in zip(token_ids, logprobs):
        top = sorted(d.values(), key=lambda lp: lp.rank or 0)[:top_n]
        content.append({**_entry(d[tok]), "top_logprobs": [_entry(lp) for lp in top]})
    return {"content": content}


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them; a 400 for what it cannot hold."""
    if not messages:
        raise bad_request("messages must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages: {len(messages)} messages; at most {MAX_MESSAGES} per "
                            "request", param="messages", code="invalid_value")
    try:
        return [{"role": m.role, "content": m.text()} for m in messages]
    except ValueError as e:
        raise bad_request(e) from None


def render_chat(tokenizer, convo: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation; template errors become a 400."""
    try:
        return tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except ValueError as e:
        raise bad_request(e) from None
    except Exception as e:  # noqa: BLE001 - jinja raises its own errors for bad conversations
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages",
                       code="invalid_value") from None


def render_and_encode(tokenizer, convo: list[dict], add_generation_prompt: bool) -> tuple[str, list[int]]:
    prompt = render_chat(tokenizer, convo, add_generation_prompt)
    # The template already holds the special tokens it wants.
    return prompt, tokenizer.encode(prompt, add_special_tokens=False)


class OpenAIServingChat(OpenAIServing):
    async def render(self, messages: list[ChatMessage],
                     add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """Template and tokenize, with the input bounded first and big work off the loop."""
        convo = conversation(messages)
        chars = sum(len(m["content"]) + len(m["role"]) for m in convo)
        self.check_text_size(chars, "messages")
        return await off_loop(render_and_encode, self.tokenizer, convo, add_generation_prompt,
                              size=chars + 16 * len(convo))

    async def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs",
                           code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.make_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        prompt, ids = await self.render(req.messages, req.add_generation_prompt)
        self.check_prompt(ids, params)
        self.check_request_tokens(len(ids), params.n)
        self.check_available(params.n)
        return ChatJob(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.settings.model_name,
                       prompt, ids, params, req.top_logprobs or 0, req.include_usage,
                       req.priority, req.cache_salt)

    async def chunks(self, job: ChatJob) -> AsyncIterator[dict]:
        head = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
                "model": job.model}
        extra = {"usage": None} if job.include_usage else {}
        gen = self.engine.generate(job.prompt_ids, job.params, job.request_id, prompt=job.prompt,
                                   priority=job.priority, cache_salt=job.cache_salt)
        for i in range(job.params.n):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
        completion_tokens = 0
        cached_tokens = 0
        async for out in gen:
            cached_tokens = max(cached_tokens, out.num_cached_tokens)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                logprobs = None
                if job.params.logprobs is not None and c.logprobs is not None:
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, job.top_logprobs)
                if not c.text and c.finish_reason is None and logprobs is None:
                    continue  # e.g. a skipped special token or a held-back partial character
                choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield {**head, "choices": [choice], **extra}
        if job.include_usage:
            n_prompt = len(job.prompt_ids)
            details = self.settings.enable_prompt_tokens_details
            yield {**head, "choices": [], "usage": usage_info(
                n_prompt, completion_tokens, cached_tokens if details else None)}

    async def collect(self, job: ChatJob) -> dict:
        job.include_usage = True
        choices: dict[int, dict] = {}
        usage = None
        async for chunk in self.chunks(job):
            if not chunk["choices"]:
                usage = chunk["usage"]
            for c in chunk["choices"]:
                choice = choices.setdefault(c["index"], {
                    "index": c["index"], "message": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None, "stop_reason": None})
                choice["message"]["content"] += c["delta"].get("content") or ""
                if c["logprobs"] is not None:
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {"content": []}
                    choice["logprobs"]["content"].extend(c["logprobs"]["content"])
                if c["finish_reason"] is not None:
                    choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c.get("stop_reason")
        return {"id": job.request_id, "object": "chat.completion", "created": job.created,
                "model": job.model, "choices": [choices[i] for i in sorted(choices)], "usage": usage}

    async def create(self, req: ChatCompletionRequest, raw: Request):
        job = await self.prepare(req)
        if req.stream:
            return StreamingResponse(sse(self.chunks(job)), media_type="text/event-stream")
        result = await until_disconnected(raw, self.collect(job))
        return result if not isinstance(result, dict) else JSONResponse(result)
