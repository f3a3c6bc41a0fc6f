"""POST /v1/completions: prompts (text or token ids) in, text out, streamed or whole.

The stream of chunks is the one source of truth: SSE sends it, the WebSocket sends it, and a
non-streamed response is the same chunks joined."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.entrypoints.openai.errors import bad_request
from kvflow.entrypoints.openai.protocol import CompletionRequest
from kvflow.entrypoints.openai.serving_engine import (OpenAIServing, merge_streams, off_loop, sse,
                                                      until_disconnected, usage_info)
from kvflow.lora_request import LoRARequest
from kvflow.outputs import Logprob
from kvflow.sampling_params import SamplingParams


@dataclass
class CompletionJob:
    request_id: str
    created: int
    model: str
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    echo: bool
    include_usage: bool
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter `model` named; None: the base model


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        offset: int) -> tuple[dict, int]:
    """OpenAI's legacy shape for the given tokens; returns it and the text offset after them."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tok, d in zip(token_ids, logprobs):
        sampled = d[tok]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob
                    for lp in sorted(d.values(), key=lambda lp: lp.rank or 0)})
        offsets.append(offset)
        offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
             "text_offset": offsets}, offset)


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> CompletionJob:
        """Check and tokenize; raises APIError (400/404/503) before anything is streamed. Every
        cap is checked before the work it bounds, and big texts are tokenized off the loop."""
        lora = self.check_model(req.model)
        params = self.make_params(req, req.max_tokens, req.logprobs)
        await self.check_constraint(params)
        prompts = self._prompts(req.prompt)
        self.check_choices(len(prompts), params.n)
        chars = 0
        for p in prompts:
            if isinstance(p, str):
                self.check_text_size(len(p), "prompt")
                chars += len(p)
        encoded = await off_loop(self._encode, prompts, req.add_special_tokens, size=chars)
        for _, ids in encoded:
            self.check_prompt(ids, params)
        self.check_request_tokens(sum(len(ids) for _, ids in encoded), params.n)
        self.check_available(len(prompts) * params.n)
        return CompletionJob(f"cmpl-{uuid.uuid4().hex}", int(time.time()),
                             lora.lora_name if lora is not None else self.settings.model_name,
                             encoded, params, req.echo, req.include_usage, req.priority,
                             req.cache_salt, lora)

    @staticmethod
    def _prompts(prompt) -> list[str | list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty")
        return prompt

    def _encode(self, prompts: list[str | list[int]],
                add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        return [(p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens))
                if isinstance(p, str) else (None, list(p)) for p in prompts]

    async def chunks(self, job: CompletionJob) -> AsyncIterator[dict]:
        n = job.params.n
        gens = [self.engine.generate(ids, job.params, f"{job.request_id}-{i}", prompt=text,
                                     priority=job.priority, cache_salt=job.cache_salt,
                                     lora_request=job.lora_request)
                for i, (text, ids) in enumerate(job.prompts)]
        echo = [(text if text is not None else self.tokenizer.decode(ids)) if job.echo else ""
                for text, ids in job.prompts]
        started: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        cached: dict[int, int] = {}  # prompt index -> its prompt tokens found in the prefix cache
        head = {"id": job.request_id, "object": "text_completion", "created": job.created,
                "model": job.model}
        async for i, out in merge_streams(gens):
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            for c in out.outputs:
                index = i * n + c.index
                text = c.text
                if index not in started:
                    started.add(index)
                    text = echo[i] + text
                    offsets[index] = len(echo[i])
                logprobs = None
                if job.params.logprobs is not None and c.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(c.token_ids, c.logprobs, offsets[index])
                completion_tokens += len(c.token_ids)
                if not text and c.finish_reason is None and logprobs is None:
                    continue  # e.g. a skipped special token or a held-back partial character
                chunk = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
                if out.kv_transfer_params is not None:  # lent blocks: where to pull them
                    chunk["kv_transfer_params"] = out.kv_transfer_params
                if job.include_usage:
                    chunk["usage"] = None
                yield chunk
        if job.include_usage:
            prompt_tokens = sum(len(ids) for _, ids in job.prompts)
            details = self.settings.enable_prompt_tokens_details
            yield {**head, "choices": [], "usage": usage_info(
                prompt_tokens, completion_tokens, sum(cached.values()) if details else None)}

    async def collect(self, job: CompletionJob) -> dict:
        """The whole response: the stream's chunks joined per choice."""
        job.include_usage = True
        choices: dict[int, dict] = {}
        usage = None
        kv_transfer_params = None
        async for chunk in self.chunks(job):
            if not chunk["choices"]:
                usage = chunk["usage"]
            kv_transfer_params = chunk.get("kv_transfer_params", kv_transfer_params)
            for c in chunk["choices"]:
                choice = choices.setdefault(c["index"], {"index": c["index"], "text": "",
                                                         "logprobs": None, "finish_reason": None,
                                                         "stop_reason": None})
                choice["text"] += c["text"]
                if c["logprobs"] is not None:
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {k: [] for k in c["logprobs"]}
                    for k, v in c["logprobs"].items():
                        choice["logprobs"][k].extend(v)
                if c["finish_reason"] is not None:
                    choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c["stop_reason"]
        result = {"id": job.request_id, "object": "text_completion", "created": job.created,
                  "model": job.model, "choices": [choices[i] for i in sorted(choices)],
                  "usage": usage}
        if kv_transfer_params is not None:
            result["kv_transfer_params"] = kv_transfer_params
        return result

    async def create(self, req: CompletionRequest, raw: Request):
        job = await self.prepare(req)
        if req.stream:
            return StreamingResponse(sse(self.chunks(job)), media_type="text/event-stream")
        result = await until_disconnected(raw, self.collect(job))
        return result if not isinstance(result, dict) else JSONResponse(result)
