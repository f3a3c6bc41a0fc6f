"""OpenAI's Responses API and Anthropic's Messages API end to end: one real `kvflow serve` of
the default model (with an API key), driven by the official `openai` and `anthropic` SDKs and
by httpx for what the SDKs would not send. Greedy decoding throughout, so that streamed and
whole answers, and the three APIs, can be compared exactly."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from server_helpers import ServerProcess, assert_server_clean

pytestmark = pytest.mark.slow

KEY = "s3cret"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
QUESTION = "Name three fruits."
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": CITY}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": CITY}
TIMEOUT = 120


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "128",
                        "--max-num-seqs", "4", "--max-waiting-requests", "4", "--api-key", KEY)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture
def clean(server):
    yield
    assert_server_clean(server, headers=HEADERS)


def post(server, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    headers = {**HEADERS, "content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=TIMEOUT)


def prompt_tokens(server, messages: list[dict], tools: list | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    resp = post(server, "/tokenize", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


# -- the Responses API -----------------------------------------------------------------------

def test_a_response_streamed_is_the_same_greedy_text(server, oai, clean):
    whole = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, **GREEDY)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    usage = whole.usage
    assert usage.input_tokens == prompt_tokens(server, [{"role": "user", "content": QUESTION}])
    assert 1 <= usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                       stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed"
                         else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == usage.output_tokens

    # the same conversation through the chat API: the same greedy answer
    chat = oai.chat.completions.create(model=MODEL, max_tokens=12, **GREEDY,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content == whole.output_text


def test_instructions_are_the_system_message(server, oai, clean):
    r = oai.responses.create(model=MODEL, input=QUESTION, instructions="Answer in French.",
                             max_output_tokens=2, **GREEDY)
    assert r.instructions == "Answer in French."
    assert r.usage.input_tokens == prompt_tokens(server, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}])


def test_text_format_json_schema_and_json_object(oai, clean):
    r = oai.responses.create(model=MODEL, input="Which city is the capital of France? Answer in JSON.",
                             max_output_tokens=40, **GREEDY,
                             text={"format": {"type": "json_schema", "name": "city",
                                              "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"
    # a question with a short answer: greedy free-form JSON from a 135M model can run on past any
    # budget at a near-tie of rounding (bf16 on AMX's tiles repeated keys about an apple)
    r = oai.responses.create(model=MODEL, input="Which city is the capital of Italy? Answer in JSON.",
                             max_output_tokens=60, text={"format": {"type": "json_object"}}, **GREEDY)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_a_function_call_and_its_follow_up_through_previous_response_id(server, oai, clean):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=30,
                             tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    call = calls[0]
    jsonschema.validate(json.loads(call.arguments), CITY)

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    follow = oai.responses.create(model=MODEL, previous_response_id=r.id, input=[answer],
                                  max_output_tokens=12, **GREEDY)
    assert follow.previous_response_id == r.id and follow.output_text
    # the same turn with the whole conversation given as items, without the store
    spelled = oai.responses.create(model=MODEL, max_output_tokens=12, store=False, **GREEDY, input=[
        *ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments}, answer])
    assert spelled.output_text == follow.output_text
    assert spelled.usage.input_tokens == follow.usage.input_tokens > r.usage.input_tokens
    # the output items handed back as they came (the SDK's objects) read the same
    handed = oai.responses.create(model=MODEL, max_output_tokens=12, store=False, **GREEDY,
                                  input=[*ask, *[o.model_dump(exclude_none=True) for o in r.output],
                                         answer])
    assert handed.output_text == follow.output_text


def test_input_items_are_listed_a_page_at_a_time(server, oai, clean):
    turn = [{"role": "user", "content": f"Say {word}."} for word in ("one", "two", "three")]
    r = oai.responses.create(model=MODEL, input=turn, max_output_tokens=2)
    newest_first = oai.responses.input_items.list(r.id)
    assert [i.content[0].text for i in newest_first.data] == ["Say three.", "Say two.", "Say one."]
    page = oai.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Say one.", "Say two."] and page.has_more
    rest = oai.responses.input_items.list(r.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Say three."] and not rest.has_more
    resp = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items?limit=1000", headers=HEADERS)
    assert openai_error(resp)["param"] == "limit"


def test_a_streamed_function_call(oai, clean):
    events = list(oai.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=40, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args
    assert events[-1].response.output[0].arguments == args
    jsonschema.validate(json.loads(args), CITY)


def test_store_false_get_and_delete(oai, clean):
    hidden = oai.responses.create(model=MODEL, input=QUESTION, store=False, max_output_tokens=2)
    assert hidden.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(hidden.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, input="More.", previous_response_id=hidden.id,
                             max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"

    kept = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, **GREEDY)
    got = oai.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text and got.status == kept.status
    [item] = oai.responses.input_items.list(kept.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == QUESTION
    oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(kept.id)


def test_a_stream_dropped_midway_frees_the_engine(oai, clean):
    with oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200,
                              stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    # `clean` checks that nothing is left running and every block is free


def openai_error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


LONE = r"\ud800"  # a JSON escape: the parsed string holds a lone surrogate
NESTED = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
DEEP = json.loads("[" * 900 + "]" * 900)  # parses, but no schema or template can go so deep


def responses_cases() -> list[tuple[dict | bytes, str]]:
    hi = {"input": QUESTION, "max_output_tokens": 2}
    return [
        ({"input": [{"role": "user", "content": "hi"}] * 5000}, "input"),
        ({"input": "a" * 40_000}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 300}]},
         "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]},
         "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c" * 300, "output": "x"}]},
         "input[0]"),
        (b'{"input": "hi", "instructions": "' + LONE.encode() + b'"}', "instructions"),
        (b'{"input": "hi", "temperature": NaN}', "temperature"),
        ({**hi, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({**hi, "metadata": {"k": "v" * 600}}, "metadata"),
        ({**hi, "tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
        ({**hi, "tools": [{"type": "web_search"}]}, "tools"),
        ({**hi, "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
        ({**hi, "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools"),
        ({**hi, "tools": [WEATHER]}, "tool_choice"),  # auto: no --tool-call-parser here
        ({**hi, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({**hi, "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}},
         "tool_choice"),
        ({**hi, "tools": [{**WEATHER, "parameters": NESTED}], "tool_choice": "required"}, "tools"),
        ({**hi, "tools": [{**WEATHER, "parameters": {"type": "object", "x": DEEP}}],
          "tool_choice": "required"}, "tools"),
        ({**hi, "text": {"format": {"type": "json_schema", "name": "x",
                                    "schema": {"type": "object", "x": DEEP}}}}, "text.format"),
        ({**hi, "previous_response_id": "r" * 1000}, "previous_response_id"),
        ({**hi, "max_output_tokens": 2**70}, "max_output_tokens"),
        ({**hi, "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
        ({**hi, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({**hi, "text": {"format": {"type": "json_schema", "name": "x",
                                    "schema": {"type": "nonsense"}}}}, "text.format"),
        ({**hi, "text": {"format": {"type": "grammar"}}}, "text"),
        ({**hi, "background": True}, "background"),
        ({**hi, "conversation": "conv_1"}, "conversation"),
        ({**hi, "reasoning": {"effort": "high"}}, "reasoning"),
        ({**hi, "include": ["reasoning.encrypted_content"]}, "include"),
        ({**hi, "truncation": "auto"}, "truncation"),
        ({**hi, "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({**hi, "top_logprobs": 5}, "top_logprobs"),
        ({**hi, "model": "gpt-5"}, "model"),
    ]


def test_hostile_or_unimplemented_responses_requests_are_a_400_naming_the_field(server, clean):
    for _ in range(2):  # more than --max-waiting-requests in all: a leak would turn into 503s
        for body, field in responses_cases():
            resp = post(server, "/v1/responses", body)
            err = openai_error(resp, 404 if field == "model" else 400)
            assert err["param"] == field, (body if isinstance(body, bytes) else
                                           str(body)[:200], err)
    err = openai_error(post(server, "/v1/responses", {"input": "hi", "previous_response_id":
                                                      "resp_unknown"}), 404)
    assert err["param"] == "previous_response_id"


def test_the_openai_sdk_reads_the_refusals(oai, clean):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools" and "web_search" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=QUESTION, background=True)
    assert e.value.body["param"] == "background"


# -- the Messages API ------------------------------------------------------------------------

def ask(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_message_streamed_is_the_same_greedy_text(server, oai, claude, clean):
    m = claude.messages.create(model=MODEL, max_tokens=12, messages=ask(), extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 12

    with claude.messages.stream(model=MODEL, max_tokens=12, messages=ask(),
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        m.usage.input_tokens, m.usage.output_tokens)

    count = claude.messages.count_tokens(model=MODEL, messages=ask())
    assert count.input_tokens == m.usage.input_tokens == prompt_tokens(server, ask())
    # the same conversation through the chat API: the same greedy answer
    chat = oai.chat.completions.create(model=MODEL, max_tokens=12, messages=ask(), **GREEDY)
    assert chat.choices[0].message.content == m.content[0].text


def test_the_stream_events_in_order(server, clean):
    body = {"model": MODEL, "max_tokens": 4, "messages": ask(), "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=TIMEOUT,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        frames = resp.read().decode().strip().split("\n\n")
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 4


def test_max_tokens_and_stop_sequences_say_why_the_message_stopped(claude, clean):
    plain = claude.messages.create(model=MODEL, max_tokens=12, messages=ask(), extra_body=GREEDY)
    text = plain.content[0].text
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=ask(), extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert text.startswith(cut.content[0].text)
    word = text.split()[1]
    stopped = claude.messages.create(model=MODEL, max_tokens=12, messages=ask(),
                                     stop_sequences=["zzz", word], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == text[:text.index(word)]


def test_a_forced_tool_call_and_its_result(claude, clean):
    weather = ask("What is the weather in Paris?")
    m = claude.messages.create(model=MODEL, max_tokens=40, messages=weather,
                               tools=[ANTHROPIC_WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)

    follow = claude.messages.create(
        model=MODEL, max_tokens=12, tools=[ANTHROPIC_WEATHER], tool_choice={"type": "none"},
        extra_body=GREEDY, messages=[*weather, {"role": "assistant", "content": m.content},
                                     {"role": "user", "content": [
                                         {"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens") and follow.content[0].type == "text"
    assert follow.usage.input_tokens > m.usage.input_tokens

    # tool_choice any, streamed: the input's JSON arrives in fragments
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=weather,
                                tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"},
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(fragments) >= 1 and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and json.loads("".join(fragments)) == final.content[0].input
    jsonschema.validate(final.content[0].input, CITY)


def test_errors_are_anthropic_sdk_exceptions(server, claude, clean):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # a well-formed image block whose data is no image: refused naming the block
    assert "messages[0].content[0]: the data is not an image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=ask(),
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="not-served", max_tokens=4, messages=ask())
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=ask())
    assert e.value.body["error"]["type"] == "authentication_error"
    # the OpenAI routes keep OpenAI's shape for the same refusal
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input=QUESTION)
    assert e.value.body["code"] == "invalid_api_key"
    # a Bearer key is accepted on the Messages API too
    resp = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": ask()})
    assert resp.status_code == 200 and resp.json()["type"] == "message"


def anthropic_error(resp: httpx.Response, status: int = 400) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error",
                                     413: "request_too_large"}[status]
    return body["error"]["message"]


def messages_cases() -> list[tuple[dict | bytes, str]]:
    hi = {"model": MODEL, "max_tokens": 2, "messages": ask()}
    return [
        ({"model": MODEL, "messages": ask()}, "max_tokens"),
        ({**hi, "max_tokens": 0}, "max_tokens"),
        ({**hi, "max_tokens": 2**70}, "max_tokens"),
        ({**hi, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({**hi, "messages": ask() * 5000}, "messages"),
        ({**hi, "messages": ask("a" * 40_000)}, "messages"),
        ({**hi, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 300}]},
         "messages.0.content"),
        ({**hi, "messages": [{"role": "system", "content": "hi"}]}, "role"),
        ({**hi, "messages": [*ask(), {"role": "assistant", "content": "1. Apples"}]},
         "messages[1]: a final assistant message (a prefill"),
        ({**hi, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "'document'"),
        ({**hi, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                           "content": [{"type": "image"}]}]}]},
         "'image'"),
        ({**hi, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                           "input": {}}]}]}, "messages[0]"),
        ({**hi, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t" * 300,
                                                           "name": "f", "input": {}}]}]}, "messages[0]"),
        (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "messages": [{"role": "user", '
         b'"content": "' + LONE.encode() + b'"}]}', "Unicode"),
        (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "temperature": NaN, "messages": []}',
         "temperature"),
        (b'{"model": "x", ', "not valid JSON"),
        ({**hi, "system": [{"type": "image"}]}, "system"),
        ({**hi, "temperature": 2}, "temperature"),
        ({**hi, "top_k": 10**9}, "top_k"),
        ({**hi, "stop_sequences": ["x"] * 100}, "stop_sequences: at most 64"),
        ({**hi, "stop_sequences": ["x" * 5000]}, "stop_sequences"),
        ({**hi, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({**hi, "output_config": {"effort": "high"}}, "output_config.effort"),
        ({**hi, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
         "output_config.format"),
        ({**hi, "container": "c"}, "container"),
        ({**hi, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({**hi, "tools": [ANTHROPIC_WEATHER]}, "tool_choice"),  # auto: no --tool-call-parser
        ({**hi, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({**hi, "tools": [ANTHROPIC_WEATHER] * 129}, "tools"),
        ({**hi, "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({**hi, "tools": [{**ANTHROPIC_WEATHER, "input_schema": {"type": "object", "x": DEEP}}],
          "tool_choice": {"type": "any"}}, "tools"),
        ({**hi, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {"x": DEEP}}]}, *ask()]},
         "messages: "),  # the template, or the count of its JSON, cannot go so deep
        ({**hi, "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
         "tool_choice"),
        ({**hi, "tool_choice": {"type": "any"}}, "tool_choice"),
    ]


def test_hostile_or_unimplemented_messages_requests_are_a_400_in_anthropics_shape(server, clean):
    for _ in range(2):  # more than --max-waiting-requests in all: a leak would turn into 503s
        for body, words in messages_cases():
            message = anthropic_error(post(server, "/v1/messages", body))
            assert words in message, (body if isinstance(body, bytes) else str(body)[:200], message)
    big = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "' + \
        b"a" * (9 * 2**20) + b'"}]}'
    assert "over the limit" in anthropic_error(post(server, "/v1/messages", big), 413)
    message = anthropic_error(post(server, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]}))
    assert "messages[0].content[0].source" in message
    assert "at most 4096" in anthropic_error(post(server, "/v1/messages/count_tokens",
                                                  {"model": MODEL, "messages": ask() * 5000}))
    anthropic_error(post(server, "/v1/messages", {"model": "nope", "max_tokens": 2,
                                                  "messages": ask()}), 404)


def nested_bodies(depth: int) -> list[tuple[str, str]]:
    deep = "[" * depth + "]" * depth
    ask_ = '"messages": [{"role": "user", "content": "hi"}]'
    model = f'"model": "{MODEL}", "max_tokens": 2'
    return [
        ("/v1/chat/completions", '{%s, "max_tokens": 2, "tool_choice": "none", "tools": [{"type": '
         '"function", "function": {"name": "f", "parameters": {"a": %s}}}]}' % (ask_, deep)),
        ("/v1/chat/completions", '{"max_tokens": 2, "messages": [{"role": "assistant", "content": "", '
         '"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": %s}}}]}]}' % deep),
        ("/v1/responses", '{"max_output_tokens": 2, "input": [{"role": "user", "content": "hi", '
         '"x": %s}]}' % deep),
        ("/v1/responses", '{"max_output_tokens": 2, "input": "hi", "tool_choice": "none", "tools": '
         '[{"type": "function", "name": "f", "parameters": {"a": %s}}]}' % deep),
        ("/v1/messages", '{%s, "messages": [{"role": "assistant", "content": [{"type": "tool_use", '
         '"id": "t", "name": "f", "input": {"a": %s}}]}, {"role": "user", "content": "hi"}]}'
         % (model, deep)),
        ("/v1/messages", '{%s, %s, "tool_choice": {"type": "none"}, "tools": [{"name": "f", '
         '"input_schema": {"a": %s}}]}' % (model, ask_, deep)),
    ]


def test_json_nested_up_to_what_the_parser_allows_is_a_400_not_a_500(server, clean):
    """The body parser allows a depth that writing the value back (as JSON, or walking it for
    lone surrogates) cannot reach: such a request is refused by name, never a 500."""
    for depth in range(930, 1000, 5):
        for path, body in nested_bodies(depth):
            resp = post(server, path, body.encode())
            assert resp.status_code in (200, 400), (depth, path, resp.text[:300])
