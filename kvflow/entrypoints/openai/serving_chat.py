"""POST /v1/chat/completions: messages (and tools) through the model's chat template, deltas
out: content, reasoning_content and tool_calls."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.entrypoints.openai.chat_output import MessageParser, merge_delta
from kvflow.entrypoints.openai.errors import APIError, bad_request
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from kvflow.entrypoints.openai.reasoning_parsers import (GptOssReasoningParser,
                                                         make_reasoning_parser,
                                                         reasoning_token_ids)
from kvflow.entrypoints.openai.serving_completion import prompt_logprobs_json
from kvflow.entrypoints.openai.serving_engine import (MAX_MESSAGES, OpenAIServing, off_loop,
                                                      refused, sse, until_disconnected,
                                                      usage_info)
from kvflow.entrypoints.openai.tool_parsers import (TOOL_PARSERS, JsonArrayToolParser,
                                                    NamedToolParser, OpenAIToolParser,
                                                    make_tool_parser)
from kvflow.entrypoints.openai.tool_schema import named_tool_schema, required_tools_schema
from kvflow.outputs import Logprob
from kvflow.lora_request import LoRARequest
from kvflow.multimodal.inputs import MultiModalData
from kvflow.multimodal.parts import ImageRef, template_content
from kvflow.request import InvalidRequestError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams


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
    tool_mode: str | None = None  # auto | required | named: how tool calls are read
    tool_name: str | None = None  # the named tool_choice
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    parallel_tool_calls: bool = True
    lora_request: LoRARequest | None = None  # the adapter `model` named; None: the base model
    prompt_logprobs: bool = False  # the response carries vLLM's `prompt_logprobs`
    multi_modal_data: MultiModalData | None = None  # its images, read and checked

    def message_parser(self) -> MessageParser:
        tools = (make_tool_parser(self.tool_call_parser) if self.tool_mode == "auto" else
                 JsonArrayToolParser() if self.tool_mode == "required" else
                 NamedToolParser(self.tool_name) if self.tool_mode == "named" else None)
        reasoning = (make_reasoning_parser(self.reasoning_parser, self.prompt)
                     if self.reasoning_parser else None)
        if isinstance(reasoning, GptOssReasoningParser):  # harmony calls go on to `openai`
            reasoning.pass_calls = isinstance(tools, OpenAIToolParser)
        one_call = self.tool_mode == "auto" and not self.parallel_tool_calls
        return MessageParser(reasoning, tools, max_calls=1 if one_call else None)


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


def conversation(messages: list[ChatMessage], images: list[ImageRef] | None = None) -> list[dict]:
    """The messages as the chat template takes them; a 400 for what it cannot hold. Image
    parts are appended to `images` in order (None: this endpoint takes none, a 400 naming
    the part)."""
    if not messages:
        raise bad_request("messages must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages: {len(messages)} messages; at most {MAX_MESSAGES} per "
                            "request", param="messages", code="invalid_value")
    refs: list[ImageRef] = []
    try:
        convo = [_template_message(m, f"messages[{i}]", refs) for i, m in enumerate(messages)]
    except InvalidRequestError as e:
        raise refused(e) from None
    except ValueError as e:
        raise bad_request(e) from None
    if refs and images is None:
        at = refs[0].where
        raise APIError(400, f"{at}: images are not counted by this endpoint; send text only",
                       param=at, code="unsupported_content")
    if images is not None:
        images.extend(refs)
    return convo


def _template_message(m: ChatMessage, where: str, refs: list[ImageRef]) -> dict:
    """One message as templates expect it: its parts (text joined, or text and `{"type":
    "image"}` in order), an assistant's `tool_calls` with their arguments as objects
    (templates write them with `tojson`), a tool's answer with its call's id."""
    content = m.content
    if isinstance(content, list):
        content = template_content([p.as_dict() for p in content], f"{where}.content", refs,
                                   offline=False)
    out = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            args = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ValueError(f"messages: the arguments of tool call {call.id!r} are not "
                                     "valid JSON") from None
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def content_chars(content) -> int:
    """The text characters of a templated message's content (a string, or parts)."""
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content)
    return len(content or "")


def json_chars(value, param: str) -> int:
    """The length of `value` as JSON; a 400 naming `param` when it is nested too deeply to
    write (the body parser allows a little more depth than writing it back needs)."""
    try:
        return len(json.dumps(value))
    except RecursionError:
        raise APIError(400, f"{param}: nested too deeply", param=param,
                       code="invalid_value") from None


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tools as transformers' `apply_chat_template(tools=...)` takes them."""
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in tools]


def render_chat(tokenizer, convo: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text of a conversation; template errors become a 400. `template_kwargs`:
    the request's chat_template_kwargs, variables the template reads."""
    try:
        return tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, tools=tools, **(template_kwargs or {}))
    except ValueError as e:
        raise bad_request(e) from None
    except Exception as e:  # noqa: BLE001 - jinja raises its own errors for bad conversations
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages",
                       code="invalid_value") from None


def render_and_encode(tokenizer, convo: list[dict], add_generation_prompt: bool,
                      tools: list[dict] | None = None,
                      template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    prompt = render_chat(tokenizer, convo, add_generation_prompt, tools, template_kwargs)
    # The template already holds the special tokens it wants.
    return prompt, tokenizer.encode(prompt, add_special_tokens=False)


class OpenAIServingChat(OpenAIServing):
    async def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Template and tokenize, with the input bounded first and big work off the loop (an
        image part is a 400 naming it: `prepare` reads images)."""
        return await self.render_conversation(conversation(messages), add_generation_prompt,
                                              tools, template_kwargs)

    async def render_conversation(self, convo: list[dict], add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None,
                                  template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """`render` of messages already as the template takes them (`conversation`)."""
        chars = sum(content_chars(m["content"]) + len(m["role"]) for m in convo)
        # tool calls' arguments and the tools are templated too (as JSON)
        chars += sum(json_chars(m["tool_calls"], "messages") for m in convo if "tool_calls" in m)
        if tools:
            chars += json_chars(tools, "tools")
        if template_kwargs:
            chars += json_chars(template_kwargs, "chat_template_kwargs")
        self.check_text_size(chars, "messages")
        return await off_loop(render_and_encode, self.tokenizer, convo, add_generation_prompt,
                              tools, template_kwargs, size=chars + 16 * len(convo))

    def tool_mode(self, req: ChatCompletionRequest, params: SamplingParams,
                  tools: list[dict] | None) -> tuple[str | None, str | None]:
        """How this request's tool calls are read (auto | required | named, and the name);
        a required or named choice also constrains the output to its calls' JSON."""
        choice = req.tool_choice
        named = choice.function.name if not isinstance(choice, str) and choice is not None else None
        if not tools:
            if choice == "required" or named is not None:
                raise APIError(400, f"tool_choice: {'required' if named is None else repr(named)}"
                                    " needs tools", param="tool_choice", code="invalid_value")
            return None, None
        if choice == "none":
            return None, None
        if choice is None or choice == "auto":
            if self.settings.tool_call_parser is None:
                raise APIError(400, 'tool_choice: "auto" needs the server started with '
                                    f"--tool-call-parser ({', '.join(TOOL_PARSERS)}); or use "
                                    'tool_choice "required" or a named function',
                               param="tool_choice", code="invalid_value")
            return "auto", None
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice: a required or named tool_choice constrains the "
                                "output itself; leave out response_format and structured_outputs",
                           param="tool_choice", code="invalid_value")
        try:
            schema = (named_tool_schema(tools, named) if named is not None else
                      required_tools_schema(tools, req.parallel_tool_calls))
            params.structured_outputs = StructuredOutputsParams(json=schema)
        except RecursionError:
            raise APIError(400, "tools: a parameter schema is nested too deeply", param="tools",
                           code="invalid_value") from None
        except ValueError as e:
            raise bad_request(e) from None
        return ("named", named) if named is not None else ("required", None)

    async def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        lora = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs",
                           code="invalid_value")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs: not available with stream=true",
                           param="prompt_logprobs", code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.make_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                  req.prompt_logprobs, lora_request=lora)
        tools = tool_dicts(req.tools)
        tool_mode, tool_name = self.tool_mode(req, params, tools)
        try:
            await self.check_constraint(params)
        except APIError as e:
            if tool_mode in ("required", "named"):  # the schema came from the tools
                raise APIError(400, f"tools: a parameter schema cannot be enforced: {e.message}",
                               param="tools", code=e.code) from None
            raise
        if self.settings.reasoning_parser == "openai_gptoss" or (
                tool_mode == "auto" and self.settings.tool_call_parser == "openai"):
            # harmony's parsers read its special tokens; the text they give out has none
            params.skip_special_tokens = False
        refs: list[ImageRef] = []
        convo = conversation(req.messages, refs)
        # images are read and checked (a hostile one named as such), then refused by a model
        # that takes none, before its template sees their parts
        mm_data, image_names = await self.load_images(refs)
        self.check_multi_modal(mm_data, image_names)
        prompt, ids = await self.render_conversation(convo, req.add_generation_prompt, tools,
                                                     req.chat_template_kwargs)
        if self.settings.reasoning_parser and params.structured_outputs is not None:
            # the thinking is free; the constraint holds from the token after `</think>`
            extra = reasoning_token_ids(
                self.settings.reasoning_parser,
                lambda text: self.tokenizer.encode(text, add_special_tokens=False), prompt)
            if extra:
                params.structured_outputs = dataclasses.replace(params.structured_outputs, **extra)
        self.check_prompt(ids, params, mm_data, image_names)
        self.check_request_tokens(len(ids), params.n)
        self.check_available(params.n)
        return ChatJob(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()),
                       lora.lora_name if lora is not None else self.settings.model_name,
                       prompt, ids, params, req.top_logprobs or 0, req.include_usage,
                       req.priority, req.cache_salt, tool_mode, tool_name,
                       self.settings.tool_call_parser, self.settings.reasoning_parser,
                       req.parallel_tool_calls, lora, req.prompt_logprobs is not None, mm_data)

    async def chunks(self, job: ChatJob) -> AsyncIterator[dict]:
        # the adapter is held from here to the end (closing the stream aborts the requests
        # first), so it cannot be unloaded under requests the core does not hold yet
        with self.loras.in_use(job.lora_request):
            async with contextlib.aclosing(self._chunks(job)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _chunks(self, job: ChatJob) -> AsyncIterator[dict]:
        head = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
                "model": job.model}
        extra = {"usage": None} if job.include_usage else {}
        gen = self.engine.generate(job.prompt_ids, job.params, job.request_id, prompt=job.prompt,
                                   priority=job.priority, cache_salt=job.cache_salt,
                                   lora_request=job.lora_request, checked=True,
                                   multi_modal_data=job.multi_modal_data)
        for i in range(job.params.n):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
        completion_tokens = 0
        cached_tokens = 0
        n_prompt = len(job.prompt_ids)
        parsers: dict[int, MessageParser] = {}
        prompt_lps = None  # on the next chunk, once the engine has them
        async for out in gen:
            # the prompt as the engine runs it: a model's processor expands each image there
            n_prompt = len(out.prompt_token_ids)
            cached_tokens = max(cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and job.prompt_logprobs:
                prompt_lps = prompt_logprobs_json(out.prompt_logprobs)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                parser = parsers.get(c.index) or parsers.setdefault(c.index, job.message_parser())
                delta = parser.feed(c.text, final=c.finish_reason is not None)
                logprobs = None
                if job.params.logprobs is not None and c.logprobs is not None:
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, job.top_logprobs)
                if not delta and c.finish_reason is None and logprobs is None:
                    continue  # e.g. a skipped special token, a held-back character or tag
                if not delta and c.finish_reason is None:
                    delta = {"content": ""}
                finish = c.finish_reason
                if finish == "stop" and parser.called:
                    finish = "tool_calls"
                choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                more = dict(extra)
                if prompt_lps is not None:
                    more["prompt_logprobs"], prompt_lps = prompt_lps, None
                if out.kv_transfer_params is not None:  # lent blocks: where to pull them
                    more["kv_transfer_params"] = out.kv_transfer_params
                yield {**head, "choices": [choice], **more}
        if job.include_usage:
            details = self.settings.enable_prompt_tokens_details
            yield {**head, "choices": [], "usage": usage_info(
                n_prompt, completion_tokens, cached_tokens if details else None)}

    async def collect(self, job: ChatJob) -> dict:
        job.include_usage = True
        choices: dict[int, dict] = {}
        usage = None
        kv_transfer_params = prompt_lps = None
        async for chunk in self.chunks(job):
            if not chunk["choices"]:
                usage = chunk["usage"]
            kv_transfer_params = chunk.get("kv_transfer_params", kv_transfer_params)
            prompt_lps = chunk.get("prompt_logprobs", prompt_lps)
            for c in chunk["choices"]:
                choice = choices.setdefault(c["index"], {
                    "index": c["index"], "message": {"role": "assistant", "content": None},
                    "logprobs": None, "finish_reason": None, "stop_reason": None})
                merge_delta(choice["message"], c["delta"])
                if c["logprobs"] is not None:
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {"content": []}
                    choice["logprobs"]["content"].extend(c["logprobs"]["content"])
                if c["finish_reason"] is not None:
                    choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c.get("stop_reason")
        for choice in choices.values():
            message = choice["message"]
            if message["content"] is None and not message.get("tool_calls"):
                message["content"] = ""  # an empty answer is "", a tool-calling one null
        result = {"id": job.request_id, "object": "chat.completion", "created": job.created,
                  "model": job.model, "choices": [choices[i] for i in sorted(choices)],
                  "usage": usage}
        if job.prompt_logprobs:  # vLLM's place: beside the choices, the prompt is theirs alike
            result["prompt_logprobs"] = prompt_lps
        if kv_transfer_params is not None:
            result["kv_transfer_params"] = kv_transfer_params
        return result

    async def create(self, req: ChatCompletionRequest, raw: Request):
        job = await self.prepare(req)
        if req.stream:
            return StreamingResponse(sse(self.chunks(job)), media_type="text/event-stream")
        result = await until_disconnected(raw, self.collect(job))
        return result if not isinstance(result, dict) else JSONResponse(result)
