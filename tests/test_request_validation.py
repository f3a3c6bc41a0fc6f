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
    (CompletionRequest, {"use_beam_search": True}, "use_beam_search"),
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


# -- constraints -----------------------------------------------------------------------
@pytest.mark.parametrize("field, value, names", [
    ("guided_json", {"type": "object"}, 'structured_outputs: {"json"'),
    ("guided_regex", "[a-z]+", 'structured_outputs: {"regex"'),
    ("guided_choice", ["a", "b"], 'structured_outputs: {"choice"'),
    ("guided_grammar", "root ::= \"a\"", 'structured_outputs: {"grammar"'),
    ("guided_decoding_backend", "xgrammar", "structured_outputs"),
])
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_removed_guided_fields_name_structured_outputs(model, field, value, names):
    body = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as info:
        model.model_validate({**body, field: value})
    message, param = validation_message(info.value.errors())
    assert param == field and message.startswith(f"{field} was removed") and names in message


def _constraint(**extra):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    return req.sampling_params(8, None).structured_outputs


def test_response_format_and_structured_outputs_become_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _constraint() is None
    assert _constraint(response_format={"type": "text"}) is None
    assert _constraint(response_format={"type": "json_object"}).kind == "json_object"
    so = _constraint(response_format={"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert so.kind == "json" and json.loads(so.json) == schema
    assert json.loads(_constraint(structured_outputs={"json": schema}).json) == schema
    assert _constraint(structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    assert _constraint(structured_outputs={"choice": ["yes", "no"]}).choice == ["yes", "no"]
    assert _constraint(structured_outputs={"grammar": 'root ::= "a"'}).kind == "grammar"
    req = CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {"regex": "a+"}})
    assert req.sampling_params(8, None).structured_outputs.regex == "a+"


@pytest.mark.parametrize("extra, starts", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs: give exactly one"),
    ({"structured_outputs": {}}, "structured_outputs: give exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs: give either"),
])
def test_bad_constraints_are_a_value_error_naming_the_field(extra, starts):
    with pytest.raises(ValueError) as info:
        _constraint(**extra)
    assert str(info.value).startswith(starts)


@pytest.mark.parametrize("extra, field", [
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
])
def test_malformed_constraint_and_tool_fields_are_refused(extra, field):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    assert validation_message(info.value.errors())[1] == field


def test_tool_messages_and_assistant_tool_calls_are_accepted():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False})
    assert req.messages[1].tool_calls[0].function.name == "get_weather"
    assert req.messages[2].tool_call_id == "call_1" and req.tool_choice.function.name == "get_weather"


@pytest.mark.parametrize("ids", [[1, 2.5, 3], [1, True, 3], [0, "7", 9]])
def test_every_id_is_checked_not_just_the_smallest_and_largest(ids):
    from kvflow.sampling_params import check_token_ids

    with pytest.raises(ValueError, match="prompt contains token id"):
        check_token_ids("prompt", ids, 100)


def test_a_reasoning_start_run_is_one_token():
    from kvflow.sampling_params import StructuredOutputsParams

    StructuredOutputsParams(regex="x", reasoning_end_token_ids=[5, 6], reasoning_start_token_ids=[4])
    with pytest.raises(ValueError, match="reasoning_start_token_ids must be one token"):
        StructuredOutputsParams(regex="x", reasoning_end_token_ids=[5],
                                reasoning_start_token_ids=[3, 4])
