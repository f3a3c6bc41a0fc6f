"""POST /v1/completions: prompts (text or token ids) in, text out, streamed or whole.

The stream of chunks is the one source of truth: SSE sends it, the WebSocket sends it, and a
non-streamed response is the same chunks joined."""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.entrypoints.openai.errors import APIError, bad_request, renamed
from kvflow.entrypoints.openai.protocol import CompletionRequest
from kvflow.entrypoints.openai.serving_engine import (OpenAIServing, merge_streams, off_loop, sse,
                                                      until_disconnected, usage_info)
from kvflow.engine.detokenizer import decode_token
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
    echo_only: bool = False  # echo with max_tokens=0: the prompt and its logprobs, no output
    prompt_logprobs: bool = False  # the choices carry vLLM's `prompt_logprobs`
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


def echo_logprobs(prompt_token_ids: list[int], prompt_logprobs: list, num: int,
                  first_text: str) -> tuple[dict, int]:
    """The legacy shape for the prompt's tokens (echo): the first (`first_text`) has no
    logprob (null), each other position its token's logprob and the top-`num` beside it."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for tok, d in zip(prompt_token_ids, prompt_logprobs):
        if d is None:  # the first position
            text = first_text
            tokens.append(text)
            token_logprobs.append(None)
            top.append(None)
        else:
            actual = d[tok]
            text = actual.decoded_token or ""
            tokens.append(text)
            token_logprobs.append(actual.logprob)
            top.append({(lp.decoded_token or ""): lp.logprob
                        for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank or 0)
                        if t == tok or (lp.rank or 0) <= num})
        offsets.append(offset)
        offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
             "text_offset": offsets}, offset)


def prompt_logprobs_json(prompt_logprobs: list) -> list:
    """vLLM's `prompt_logprobs` of a choice: per position None or {token id: Logprob}."""
    return [None if d is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in d.items()} for d in prompt_logprobs]


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> CompletionJob:
        """Check and tokenize; raises APIError (400/404/503) before anything is streamed. Every
        cap is checked before the work it bounds, and big texts are tokenized off the loop."""
        lora = self.check_model(req.model)
        # OpenAI's scoring request (echo, max_tokens=0, logprobs=N): the prompt comes back with
        # its logprobs and nothing is generated; the engine samples one token, dropped here
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 is allowed only with echo (to score the prompt); "
                                "give at least 1", param="max_tokens", code="invalid_value")
        # echo with logprobs scores the prompt too (vLLM: prompt_logprobs from logprobs)
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        try:
            params = self.make_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                                      prompt_lp, lora)
        except APIError as e:
            if req.prompt_logprobs is None:  # the prompt logprobs were echo's: name it
                raise renamed(e, {"prompt_logprobs": "echo"}) from None
            raise
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
                             req.cache_salt, echo_only, req.prompt_logprobs is not None, lora)

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
        # the adapter is held from here to the end (closing the stream aborts the requests
        # first), so it cannot be unloaded under requests the core does not hold yet
        with self.loras.in_use(job.lora_request):
            async with contextlib.aclosing(self._chunks(job)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _chunks(self, job: CompletionJob) -> AsyncIterator[dict]:
        n = job.params.n
        gens = [self.engine.generate(ids, job.params, f"{job.request_id}-{i}", prompt=text,
                                     priority=job.priority, cache_salt=job.cache_salt,
                                     lora_request=job.lora_request, checked=True)
                for i, (text, ids) in enumerate(job.prompts)]
        echo = [(text if text is not None else self.tokenizer.decode(ids)) if job.echo else ""
                for text, ids in job.prompts]
        started: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        cached: dict[int, int] = {}  # prompt index -> its prompt tokens found in the prefix cache
        prompt_lps: dict[int, list] = {}  # prompt index -> its prompt logprobs, once known
        echo_lps = job.echo and job.params.logprobs is not None
        head = {"id": job.request_id, "object": "text_completion", "created": job.created,
                "model": job.model}
        async for i, out in merge_streams(gens):
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * n + c.index
                text, token_ids, lps = c.text, c.token_ids, c.logprobs
                finish, stop_reason = c.finish_reason, c.stop_reason
                if job.echo_only:  # the one sampled token is not part of the answer
                    text, token_ids, lps = "", [], [] if lps is not None else None
                    if finish is not None:
                        finish, stop_reason = "length", None
                first = index not in started
                extra = {}
                logprobs = None
                if first:
                    started.add(index)
                    text = echo[i] + text
                    offsets[index] = len(echo[i])
                    if echo_lps and i in prompt_lps:
                        ids = job.prompts[i][1]
                        logprobs, offsets[index] = echo_logprobs(
                            ids, prompt_lps[i], job.params.logprobs,
                            decode_token(self.tokenizer, ids[0]))
                    if job.prompt_logprobs and i in prompt_lps:
                        extra["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[i])
                if job.params.logprobs is not None and lps is not None:
                    part, offsets[index] = completion_logprobs(token_ids, lps, offsets[index])
                    logprobs = part if logprobs is None else {
                        k: logprobs[k] + part[k] for k in logprobs}
                completion_tokens += len(token_ids)
                if not text and finish is None and logprobs is None:
                    continue  # e.g. a skipped special token or a held-back partial character
                chunk = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish,
                                              "stop_reason": stop_reason, **extra}]}
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
                if "prompt_logprobs" in c:
                    choice["prompt_logprobs"] = c["prompt_logprobs"]
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
