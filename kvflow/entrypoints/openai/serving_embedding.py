"""POST /v1/embeddings: texts or token ids in, one pooled vector each out (OpenAI's shape).

Each input is one prefill-only request in the same engine as generation: the scheduler
batches it beside the decodes, it ends with its prompt and frees its blocks at once."""
from __future__ import annotations

import asyncio
import base64
import sys
import time
import uuid
from array import array
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.protocol import OpenAIBaseModel
from kvflow.entrypoints.openai.serving_engine import OpenAIServing, off_loop, until_disconnected
from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.request import InvalidRequestError

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on one request's inputs


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's embeddings request, with vLLM's extensions `normalize`, `add_special_tokens`
    and `priority`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, body: Any) -> Any:
        if isinstance(body, dict) and body.get("truncate_prompt_tokens") is not None:
            raise PydanticCustomError("unsupported_field", "{param}: kvflow does not implement "
                                      "this field; leave it out",
                                      {"param": "truncate_prompt_tokens"})
        return body


def _b64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 little-endian bytes."""
    a = array("f", vec)
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw: Request):
        lora = self.check_model(req.model)
        try:
            params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions" if req.dimensions is not None
                           else "normalize", code="invalid_value") from None
        inputs = self._inputs(req.input)
        chars = 0
        for p in inputs:
            if isinstance(p, str):
                self.check_text_size(len(p), "input")
                chars += len(p)
        encoded = await off_loop(self._encode, inputs, req.add_special_tokens, size=chars)
        for i, ids in enumerate(encoded):  # every input, before any is queued
            try:
                self.input_processor.process_pooling(ids, params, lora, name="input")
            except InvalidRequestError as e:
                where = f" (input {i})" if len(encoded) > 1 else ""
                raise APIError(400, f"input: {e}{where}", param="input",
                               code="invalid_value") from None
            except ValueError as e:
                raise APIError(400, str(e), param="input", code="invalid_value") from None
        self.check_request_tokens(sum(map(len, encoded)), 1)
        self.check_available(len(encoded))
        request_id = f"embd-{uuid.uuid4().hex}"
        created = int(time.time())
        with self.loras.in_use(lora):
            result = await until_disconnected(raw, self._embed(request_id, encoded, params,
                                                               req.priority, lora))
        if not isinstance(result, list):
            return result  # the client went away
        data = [{"object": "embedding", "index": i,
                 "embedding": _b64(vec) if req.encoding_format == "base64" else vec}
                for i, vec in enumerate(result)]
        n = sum(map(len, encoded))
        return JSONResponse({"id": request_id, "object": "list", "created": created,
                             "model": lora.lora_name if lora is not None
                             else self.settings.model_name, "data": data,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def _embed(self, request_id: str, encoded: list[list[int]], params: PoolingParams,
                     priority: int, lora: LoRARequest | None) -> list[list[float]]:
        tasks = [asyncio.ensure_future(self.engine.encode(ids, params, f"{request_id}-{i}",
                                                          priority=priority, checked=True,
                                                          lora_request=lora))
                 for i, ids in enumerate(encoded)]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # cancelled: each aborts its request in the engine
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [o.outputs.embedding for o in outs]

    @staticmethod
    def _inputs(value) -> list[str | list[int]]:
        if isinstance(value, str):
            value = [value]
        elif value and isinstance(value[0], int):
            value = [value]
        if not value:
            raise APIError(400, "input must not be empty", param="input", code="invalid_value")
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input: {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} per "
                                "request", param="input", code="invalid_value")
        for v in value:
            if not v:
                raise APIError(400, "input: each input must be a non-empty string or token list",
                               param="input", code="invalid_value")
        return value

    def _encode(self, inputs: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
                if isinstance(p, str) else list(p) for p in inputs]
