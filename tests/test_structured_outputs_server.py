"""Structured outputs and tool calling through a real `kvflow serve` (the default model, fp32,
greedy): the official `openai` client's `parse()`, tools with required / named / auto
tool_choice, streamed tool-call deltas, regex / choice / grammar constraints on both endpoints
and the WebSocket, reasoning content, and the 400s for what cannot be served."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
import websockets
from pydantic import BaseModel, Field

from server_helpers import ServerProcess, assert_server_clean

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 300
pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "1024", "--num-blocks", "512", "--dtype", "float32",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=TIMEOUT)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    assert_server_clean(server)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=TIMEOUT)


def error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def schema_of(tool_name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == tool_name)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    is_capital: bool


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=200)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    City.model_validate_json(choice.message.content)


def test_json_object_and_json_schema_response_formats(client):
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}):
        out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                             temperature=0, max_tokens=200)
        value = json.loads(out.choices[0].message.content)
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, WEATHER)


def test_required_tool_choice_returns_calls_that_validate(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", temperature=0, max_tokens=300)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_one_call_without_parallel_tool_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=0, max_tokens=300)
    assert len(out.choices[0].message.tool_calls) == 1


def test_named_tool_choice_calls_that_tool(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def reassemble(stream) -> tuple[list[dict], str | None, str]:
    """The calls a stream's `delta.tool_calls` make, its finish_reason and content."""
    calls: list[dict] = []
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index == len(calls):  # a new call: id, type and name come first
                    assert d.id and d.type == "function" and d.function.name
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_into_the_same_calls(client, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
              max_tokens=300)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish, content = reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_tool_choice_reads_the_models_hermes_calls(client):
    """The tiny model does not call tools by itself: a choice constraint makes it write the
    Hermes format, which the server's --tool-call-parser hermes reads."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", ' \
           '"unit": "celsius"}}\n</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100,
              extra_body={"structured_outputs": {"choice": [text]}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking.\n"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Tokyo", "unit": "celsius"}
    calls, finish, content = reassemble(client.chat.completions.create(stream=True, **kw))
    assert (finish, content) == ("tool_calls", "Checking.\n")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert none.message.content == text and not none.message.tool_calls
    assert none.finish_reason == "stop"


def test_reasoning_content_is_split_from_content(client, server):
    text = "<think>The user wants a city.</think>\n\nParis"
    body = {"messages": ASK, "temperature": 0, "max_tokens": 60,
            "structured_outputs": {"choice": [text]}}
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants a city." and message["content"] == "Paris"
    reasoning = content = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                      json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    reasoning += c["delta"].get("reasoning_content") or ""
                    content += c["delta"].get("content") or ""
    assert (reasoning, content) == ("The user wants a city.", "Paris")


def test_tool_messages_round_trip_through_the_template(client, server):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]
    resp = post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert resp.status_code == 200, resp.text
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert "sunny, 21 degrees" in prompt
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=8)
    assert out.choices[0].message.content


def test_a_constraint_waits_for_the_reasoning_the_parser_expects():
    from kvflow.entrypoints.openai.reasoning_parsers import reasoning_token_ids

    vocab = {"<think>": [7], "</think>": [8]}
    encode = vocab.__getitem__
    both = {"reasoning_end_token_ids": [8], "reasoning_start_token_ids": [7]}
    assert reasoning_token_ids("qwen3", encode, "<|im_start|>assistant\n") == both
    assert reasoning_token_ids("qwen3", encode, "assistant\n<think>\n") == \
        {"reasoning_end_token_ids": [8]}  # the template opened it
    assert reasoning_token_ids("qwen3", encode, "assistant\n<think>\n\n</think>\n\n") == {}
    assert reasoning_token_ids("deepseek_r1", encode, "Assistant:") == \
        {"reasoning_end_token_ids": [8]}
    # a tokenizer without a <think> token does not think: constrained from the start
    assert reasoning_token_ids("qwen3", {"<think>": [1, 2], "</think>": [3, 2]}.__getitem__,
                               "assistant\n") == {}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_regex_choice_and_grammar_constraints(client, endpoint):
    cases = [({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2}", s)),
             ({"choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
             ({"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'},
              lambda s: re.fullmatch(r"yes|no|maybe [0-9]", s))]
    for so, ok in cases:
        if endpoint == "chat":
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Answer."}], temperature=0,
                max_tokens=40, extra_body={"structured_outputs": so})
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        else:
            out = client.completions.create(model=MODEL, prompt="The answer is", temperature=0,
                                            max_tokens=40, extra_body={"structured_outputs": so})
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert ok(text), (so, text)
        assert finish == "stop"


def test_completions_accept_response_format(client):
    out = client.completions.create(model=MODEL, prompt="A JSON object:", temperature=0,
                                    max_tokens=200, extra_body={"response_format": {
                                        "type": "json_schema",
                                        "json_schema": {"name": "w", "schema": WEATHER}}})
    jsonschema.validate(json.loads(out.choices[0].text), WEATHER)


def test_websocket_request_with_a_constraint(server):
    url = server.url.replace("http", "ws") + "/v1/ws"

    async def session():
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"id": "a", "type": "chat", "messages": ASK, "temperature": 0,
                                      "max_tokens": 40,
                                      "structured_outputs": {"choice": ["sunny", "rainy"]}}))
            await ws.send(json.dumps({"id": "b", "prompt": "Weather:", "temperature": 0,
                                      "max_tokens": 40, "structured_outputs": {"regex": "[0-9]{2}C"}}))
            texts, ends = {"a": "", "b": ""}, {}
            while len(ends) < 2:
                msg = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                if msg["type"] == "chunk":
                    for c in msg["data"]["choices"]:
                        texts[msg["id"]] += c.get("text") or c.get("delta", {}).get("content") or ""
                else:
                    ends[msg["id"]] = msg["type"]
            return texts, ends

    texts, ends = asyncio.run(session())
    assert ends == {"a": "done", "b": "done"}
    assert texts["a"] in ("sunny", "rainy") and re.fullmatch("[0-9]{2}C", texts["b"])


@pytest.mark.parametrize("field, value", [
    ("guided_json", WEATHER), ("guided_regex", "[a-z]+"), ("guided_choice", ["a", "b"]),
    ("guided_grammar", 'root ::= "a"'), ("guided_decoding_backend", "xgrammar")])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_removed_guided_fields_are_a_400_naming_structured_outputs(server, path, field, value):
    body = {"messages": ASK} if "chat" in path else {"prompt": "Hi"}
    err = error(post(server, path, {**body, "max_tokens": 4, field: value}))
    assert err["param"] == field and "was removed" in err["message"]
    assert "structured_outputs" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": 7}}}}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     None),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_invalid_constraints_are_a_400_naming_the_problem(server, body, param):
    for path, base in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "Hi"})):
        if "tool" in json.dumps(body) and path == "/v1/completions":
            continue  # tools are a chat matter
        err = error(post(server, path, {**base, "max_tokens": 8, **body}))
        if param is not None:
            assert err["param"] == param, err
        assert err["message"]


@pytest.mark.parametrize("depth", [50, 400])
def test_deeply_nested_schemas_are_answered_never_a_500(server, depth):
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for body in ({"messages": ASK, "structured_outputs": {"json": schema}},
                 {"messages": ASK, "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": schema}}},
                 {"messages": ASK, "tools": tools, "tool_choice": "required"},
                 {"messages": ASK, "tools": tools, "tool_choice": {"type": "function",
                                                                   "function": {"name": "f"}}}):
        resp = post(server, "/v1/chat/completions", {**body, "max_tokens": 4})
        assert resp.status_code in (200, 400), resp.text


@pytest.mark.parametrize("depth", [480, 2000])
def test_schemas_nested_past_the_encoders_limit_are_a_400(server, depth):
    schema = '{"type": "integer"}'
    for _ in range(depth):
        schema = '{"type": "object", "properties": {"a": %s}}' % schema
    tools = '[{"type": "function", "function": {"name": "f", "parameters": %s}}]' % schema
    ask = json.dumps(ASK)
    for body in ('{"messages": %s, "structured_outputs": {"json": %s}}' % (ask, schema),
                 '{"messages": %s, "tools": %s, "tool_choice": "required"}' % (ask, tools),
                 '{"messages": %s, "tools": %s, "tool_choice": "none"}' % (ask, tools)):
        resp = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400), resp.text
