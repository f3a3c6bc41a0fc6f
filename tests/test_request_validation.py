"""Request validation without a server: SamplingParams' bounds, the vocabulary checks, the
protocol models (lone surrogates, known-but-unimplemented fields) and the error bodies. What
passes here must also cross the frontend -> core channel (64-bit msgpack)."""
from __future__ import annotations

import asyncio
import json
import math

import msgspec
import pytest
from pydantic import ValidationError

from kvflow.engine.protocol import EngineCoreRequest
from kvflow.entrypoints.openai.errors import error_body, validation_message
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvflow.sampling_params import (MAX_LOGIT_BIAS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS, SamplingParams, check_token_ids)

VOCAB = 49152
LONE = "\ud800"


def round_trip(params: SamplingParams) -> SamplingParams:
    enc = msgspec.msgpack.Encoder()
    raw = enc.encode(EngineCoreRequest("r", [1, 2], params))
    return msgspec.msgpack.decode(raw, type=EngineCoreRequest).sampling_params


# -- SamplingParams --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed must be at most 2**64 - n"),
    ({"top_k": 2**70}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS}"),
    ({"stop": ["x"] * 100_000}, f"at most {MAX_STOP_STRINGS} stop strings"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, f"at most {MAX_STOP_STRING_CHARS} characters"),
    ({"stop": [LONE]}, "not valid Unicode"),
    ({"stop": ["ok", 5]}, "stop must be strings"),
    ({"n": MAX_N + 1}, f"n must be at most {MAX_N}"),
    ({"n": True}, "n must be at least 1"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_tokens": None, "min_tokens": 2**70}, "min_tokens"),
    ({"logprobs": 2**70}, "logprobs"),
    ({"logit_bias": {2**70: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "[-100, 100]"),
    ({"logit_bias": {5: math.nan}}, "[-100, 100]"),
    ({"logit_bias": {5: math.inf}}, "[-100, 100]"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, f"at most {MAX_LOGIT_BIAS}"),
    ({"temperature": math.nan}, "finite"),
])
def test_out_of_bounds_sampling_params_are_refused_by_name(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value)


def test_every_accepted_extreme_crosses_the_wire():
    extremes = [
        SamplingParams(seed=2**64 - 1), SamplingParams(seed=2**64 - 128, n=128),
        SamplingParams(seed=-(2**63), n=128), SamplingParams(top_k=2**31 - 1),
        SamplingParams(max_tokens=2**31 - 1, min_tokens=2**31 - 1),
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
        SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS),
        SamplingParams(logit_bias={i: -100.0 + i % 201 for i in range(MAX_LOGIT_BIAS)}),
        SamplingParams(stop=["\U0001f600 emoji", "é"]),
    ]
    for p in extremes:
        assert round_trip(p) == p


def test_seed_of_sample_i_stays_within_64_bits():
    p = SamplingParams(seed=2**64 - 3, n=3)
    assert p.seed + p.n - 1 == 2**64 - 1
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 2, n=3)


def test_ids_and_top_k_are_checked_against_the_vocabulary():
    SamplingParams(stop_token_ids=[VOCAB - 1], logit_bias={0: 1}, top_k=VOCAB).verify_token_ids(VOCAB)
    for params, field in [(SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
                          (SamplingParams(logit_bias={VOCAB: 5}), "logit_bias"),
                          (SamplingParams(top_k=VOCAB + 1), "top_k")]:
        with pytest.raises(ValueError, match=rf"^{field}"):
            params.verify_token_ids(VOCAB)
    check_token_ids("prompt", [0, 1, VOCAB - 1], VOCAB)
    for ids in ([1, VOCAB], [-1], [1, 2**70], [1, "2"], [1.0]):
        with pytest.raises(ValueError, match="^prompt contains token id"):
            check_token_ids("prompt", ids, VOCAB)


def test_logit_bias_keys_are_token_ids_and_empty_means_none():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={7: 100, 8: -100.0}).logit_bias == {7: 100, 8: -100.0}


# -- protocol models -------------------------------------------------------------------------

def raw(text: str) -> dict:
    """Parse JSON the way the server does: `\\ud800` escapes become lone surrogates."""
    return json.loads(text)


@pytest.mark.parametrize("model, body, field", [
    (CompletionRequest, r'{"prompt": "hi \ud800"}', "prompt"),
    (CompletionRequest, r'{"prompt": ["ok", "\udfff"]}', "prompt"),
    (CompletionRequest, r'{"prompt": "hi", "stop": "\ud800"}', "stop"),
    (CompletionRequest, r'{"prompt": "hi", "stop": ["a", "\ud800"]}', "stop"),
    (CompletionRequest, r'{"prompt": "hi", "user": "\ud800"}', "user"),
    (CompletionRequest, r'{"prompt": "hi", "model": "\ud800"}', "model"),
    (CompletionRequest, r'{"prompt": "hi", "cache_salt": "\ud800"}', "cache_salt"),
    (ChatCompletionRequest, r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
    (ChatCompletionRequest, r'{"messages": [{"role": "\ud800", "content": "x"}]}', "messages"),
    (ChatCompletionRequest,
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}', "messages"),
    (TokenizeRequest, r'{"prompt": "\ud800"}', "prompt"),
])
def test_lone_surrogates_are_refused_in_every_string_field(model, body, field):
    with pytest.raises(ValidationError) as info:
        model.model_validate(raw(body))
    message, param = validation_message(info.value.errors())
    assert param == field and "unicode" in message.lower()
    json.dumps(error_body(400, message, param)).encode("utf-8")  # the error itself is sendable


def test_valid_non_ascii_text_passes():
    req = CompletionRequest.model_validate(raw(r'{"prompt": "caf\u00e9 \ud83d\ude00", "stop": ["\u00e9"]}'))
    assert req.prompt == "café \U0001f600"


@pytest.mark.parametrize("model, extra, field", [
    (CompletionRequest, {"best_of": 3}, "best_of"),
    (CompletionRequest, {"best_of": 2, "n": 1}, "best_of"),
    (CompletionRequest, {"suffix": "end"}, "suffix"),
    (CompletionRequest, {"response_format": {"type": "json_object"}}, "response_format"),
    (CompletionRequest, {"use_beam_search": True}, "use_beam_search"),
    (CompletionRequest, {"guided_json": {"type": "object"}}, "guided_json"),
    (ChatCompletionRequest, {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    (ChatCompletionRequest, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (ChatCompletionRequest, {"tool_choice": "required"}, "tool_choice"),
    (ChatCompletionRequest, {"best_of": 4}, "best_of"),
    (ChatCompletionRequest, {"modalities": ["text", "audio"]}, "modalities"),
    (ChatCompletionRequest, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_known_but_unimplemented_fields_are_refused_by_name(model, extra, field):
    body = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as info:
        model.model_validate({**body, **extra})
    message, param = validation_message(info.value.errors())
    assert param == field and message.startswith(field) and "does not implement" in message


@pytest.mark.parametrize("extra", [
    {"best_of": 1}, {"best_of": 2, "n": 2}, {"best_of": None}, {"response_format": {"type": "text"}},
    {"user": "u"}, {"some_future_field": {"x": 1}}, {"suffix": ""}, {"logit_bias": {}},
    {"metadata": {"k": "v"}}, {"store": False}, {"parallel_tool_calls": True},
])
def test_defaults_of_unimplemented_fields_and_unknown_fields_pass(extra):
    CompletionRequest.model_validate({"prompt": "hi", **extra})
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})


def test_logit_bias_keys_arrive_as_strings_and_become_ids():
    req = CompletionRequest.model_validate(raw('{"prompt": "hi", "logit_bias": {"50": 100, "7": -100}}'))
    params = req.sampling_params(4, None)
    assert params.logit_bias == {50: 100.0, 7: -100.0}
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(raw('{"prompt": "hi", "logit_bias": {"x": 1}}'))


def test_error_bodies_escape_what_utf8_cannot_carry():
    body = error_body(400, f"model {LONE} is unknown", param=LONE)
    text = json.dumps(body, ensure_ascii=False).encode("utf-8").decode("utf-8")
    assert "\\ud800" in text


# -- the WebSocket session -------------------------------------------------------------------

class _FakeSocket:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))


class _ForeverServing:
    """Accepts every request and streams nothing until cancelled."""

    async def prepare(self, req):
        return req

    async def chunks(self, job):
        await asyncio.Event().wait()
        yield {}


def test_a_websocket_caps_its_requests_in_flight_and_survives_bad_frames():
    from kvflow.entrypoints.openai.serving_ws import MAX_REQUESTS_PER_SOCKET, WebSocketSession

    async def run() -> list[dict]:
        ws = _FakeSocket()
        session = WebSocketSession(ws, _ForeverServing(), _ForeverServing())
        for i in range(MAX_REQUESTS_PER_SOCKET + 1):
            await session.handle(json.dumps({"id": f"r{i}", "prompt": "hi"}))
        await session.handle("[" * 100_000 + "]" * 100_000)
        await session.handle('{"id": "' + r"\ud800" + '", "prompt": "hi"}')
        await session.handle(json.dumps({"id": "x" * 1000, "prompt": "hi"}))
        await asyncio.sleep(0)
        assert len(session.tasks) == MAX_REQUESTS_PER_SOCKET
        await session.handle(json.dumps({"type": "cancel", "id": "r0"}))
        await session.handle(json.dumps({"id": "again", "prompt": "hi"}))  # room again
        assert len(session.tasks) == MAX_REQUESTS_PER_SOCKET
        for t in session.tasks.values():
            t.cancel()
        await asyncio.gather(*session.tasks.values(), return_exceptions=True)
        return ws.sent

    sent = asyncio.run(run())
    over, deep, lone, long_id, cancelled = sent
    assert over["id"] == f"r{MAX_REQUESTS_PER_SOCKET}" and over["error"]["code"] == "too_many_requests"
    assert deep["id"] is None and "nested too deeply" in deep["error"]["message"]
    assert lone["id"] is None and lone["error"]["param"] == "id"
    assert long_id["id"] is None and long_id["error"]["param"] == "id"
    assert cancelled == {"type": "cancelled", "id": "r0"}
