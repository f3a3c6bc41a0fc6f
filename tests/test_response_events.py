"""The Responses and Messages APIs without a model: chat chunks in, their events and final
objects out; input items and content blocks to chat messages; the bounded response store;
the API key in either header."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvflow.engine.core_client import EngineDeadError
from kvflow.entrypoints.anthropic.protocol import MessagesRequest
from kvflow.entrypoints.anthropic.serving_messages import AnthropicServingMessages, MessageStream
from kvflow.entrypoints.anthropic.serving_messages import chat_messages as anthropic_messages
from kvflow.entrypoints.openai.api_server import Gate
from kvflow.entrypoints.openai.chat_output import MessageParser
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.responses_protocol import ResponsesRequest, input_items
from kvflow.entrypoints.openai.server_settings import ServerSettings
from kvflow.entrypoints.openai.serving_responses import (OpenAIServingResponses, ResponseStream,
                                                         chat_messages, response_skeleton)
from kvflow.entrypoints.openai.tool_parsers import HermesToolParser


def chunk(delta: dict, finish: str | None = None, stop_reason=None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {"choices": [choice]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


# what the chat path yields for a reasoning model that answers, then calls a tool
THINK_SAY_CALL = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "The user wants "}), chunk({"reasoning_content": "weather."}),
    chunk({"content": "Let me check."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
          finish="tool_calls"),
    usage(20, 12),
]


def run_response(chunks: list[dict], **request) -> tuple[list[dict], dict]:
    req = ResponsesRequest.model_validate({"input": "hi", **request})
    stream = ResponseStream(response_skeleton(req, "m"), count_tokens=lambda t: len(t.split()))
    events = stream.begin()
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    return events, stream


def test_reasoning_text_and_a_call_are_three_items_each_opened_streamed_and_closed():
    events, stream = run_response(THINK_SAY_CALL)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    r = stream.response
    assert [i["type"] for i in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][0]["content"][0] == {"type": "reasoning_text",
                                            "text": "The user wants weather."}
    assert r["output"][1]["content"][0]["text"] == "Let me check."
    call = r["output"][2]
    assert (call["name"], call["call_id"], call["arguments"]) == (
        "get_weather", "call_1", '{"city": "Paris"}')
    assert all(i["status"] == "completed" for i in r["output"])
    assert r["status"] == "completed" and events[-1]["response"]["status"] == "completed"
    assert r["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 4},
                          "total_tokens": 32}
    # the events carry what the item held then, not what it became
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[1]["item"]["content"] == [] and added[2]["item"]["arguments"] == ""
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == '{"city": "Paris"}'
    assert stream.history_message() == {
        "role": "assistant", "content": "Let me check.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_a_response_cut_by_max_output_tokens_is_incomplete():
    events, stream = run_response([chunk({"content": "Once upon"}, finish="length"), usage(3, 2)],
                                  max_output_tokens=2)
    assert events[-1]["type"] == "response.incomplete"
    assert stream.response["status"] == "incomplete"
    assert stream.response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_empty_answer_is_one_empty_message():
    events, stream = run_response([chunk({"role": "assistant", "content": ""}),
                                   chunk({}, finish="stop"), usage(3, 1)])
    assert [i["type"] for i in stream.response["output"]] == ["message"]
    assert stream.response["output"][0]["content"][0]["text"] == ""
    assert "response.output_text.delta" not in [e["type"] for e in events]
    assert "response.output_text.done" in [e["type"] for e in events]


def test_input_items_become_chat_messages():
    items = input_items([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ])
    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]


@pytest.mark.parametrize("item, param, words", [
    ({"type": "item_reference", "id": "msg_1"}, "input[1]", "'item_reference' items are not supported"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[1]", "not supported"),
    ({"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}, "input[1]",
     "'input_image' content is not supported here"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]},
     "input[1].content[0]", "file_id: uploaded files are not implemented"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "input[1]",
     "'input_audio' content is not supported"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[1]", "call_id"),
    ({"role": "tool", "content": "x"}, "input[1]", "role"),
])
def test_unreadable_items_are_refused_naming_them(item, param, words):
    with pytest.raises(APIError) as e:
        input_items([{"role": "user", "content": "hi"}, item])
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_messages_stream_blocks_thinking_text_and_tool_use():
    stream = MessageStream("m", input_tokens=20, stop_sequences=None)
    events = stream.begin()
    for c in THINK_SAY_CALL:
        events += stream.feed(c)
    events += stream.finish()
    kinds = [(e["type"], e.get("delta", {}).get("type") or
              e.get("content_block", {}).get("type")) for e in events]
    assert kinds == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None)]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    m = stream.message
    assert m["content"][0] == {"type": "thinking", "thinking": "The user wants weather.",
                               "signature": ""}
    assert m["content"][1] == {"type": "text", "text": "Let me check."}
    assert m["content"][2]["type"] == "tool_use" and m["content"][2]["input"] == {"city": "Paris"}
    assert m["content"][2]["id"].startswith("toolu_")
    assert (m["stop_reason"], m["stop_sequence"]) == ("tool_use", None)
    assert m["usage"] == {"input_tokens": 20, "output_tokens": 12}
    assert events[-2]["usage"] == {"input_tokens": 20, "output_tokens": 12}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None


@pytest.mark.parametrize("finish, matched, reason, sequence", [
    ("stop", None, "end_turn", None), ("stop", 2, "end_turn", None),
    ("stop", "Banana", "stop_sequence", "Banana"), ("length", None, "max_tokens", None)])
def test_stop_reasons(finish, matched, reason, sequence):
    stream = MessageStream("m", 3, stop_sequences=["Banana"])
    stream.feed(chunk({"content": "1. "}, finish=finish, stop_reason=matched))
    stream.finish()
    assert (stream.message["stop_reason"], stream.message["stop_sequence"]) == (reason, sequence)


def test_content_blocks_become_chat_messages():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}]})
    assert anthropic_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def stored(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "output": [], "pad": "x" * pad}


def test_the_store_forgets_the_least_recently_used_past_its_count():
    store = ResponseStore(max_items=3, max_bytes=2**20)
    for i in range(3):
        store.put(stored(i), [])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(stored(3), [])
    assert store.get("resp_1") is None
    assert {r for r in ("resp_0", "resp_2", "resp_3") if store.get(r)} == {"resp_0", "resp_2", "resp_3"}
    assert store.delete("resp_2") and not store.delete("resp_2") and len(store) == 2


def test_the_store_is_bounded_in_bytes():
    store = ResponseStore(max_items=100, max_bytes=10_000)
    for i in range(10):
        store.put(stored(i, pad=3000), [{"role": "user", "content": "hi"}])
        assert store.bytes <= 10_000
    assert len(store) == 3 and store.get("resp_9") is not None
    store.put(stored(99, pad=20_000), [])  # too big for the whole store: not kept
    assert store.get("resp_99") is None and len(store) == 3
    for i in range(7, 10):
        store.delete(f"resp_{i}")
    assert store.bytes == 0


def scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "headers": list(headers)}


def test_the_api_key_comes_as_a_bearer_token_or_as_x_api_key():
    gate = Gate(None, ServerSettings(api_key="s3cret"))
    assert gate._authorized(scope((b"authorization", b"Bearer s3cret")))
    assert gate._authorized(scope((b"x-api-key", b"s3cret"), (b"anthropic-version", b"2023-06-01")))
    assert not gate._authorized(scope((b"x-api-key", b"wrong")))
    assert not gate._authorized(scope((b"authorization", b"Bearer wrong"), (b"x-api-key", b"s3cret")))
    assert not gate._authorized(scope())


async def failing(events: list[dict], error: BaseException):
    for e in events:
        yield e
    raise error


def frames(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for frame in raw:
        event, data = frame.decode().rstrip("\n").split("\n")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def collect(agen) -> list[bytes]:
    return [b async for b in agen]


def test_an_error_in_a_begun_responses_stream_is_an_error_event():
    req = ResponsesRequest.model_validate({"input": "hi"})
    stream = ResponseStream(response_skeleton(req, "m"))
    gen = failing(stream.begin(), APIError(400, "prompt: too long", "prompt", "invalid_value"))
    got = frames(asyncio.run(collect(OpenAIServingResponses.sse(gen, stream))))
    assert [name for name, _ in got] == ["response.created", "response.in_progress", "error"]
    assert got[-1][1] == {"type": "error", "code": "invalid_value", "message": "prompt: too long",
                          "param": "prompt", "sequence_number": 2}


def test_an_error_in_a_begun_messages_stream_is_an_anthropic_error_event():
    stream = MessageStream("m", 3, None)
    gen = failing(stream.begin(), EngineDeadError("the engine core process exited"))
    got = frames(asyncio.run(collect(AnthropicServingMessages.sse(gen))))
    assert [name for name, _ in got] == ["message_start", "ping", "error"]
    assert got[-1][1]["type"] == "error"
    assert got[-1][1]["error"]["type"] == "overloaded_error"
    assert "engine" in got[-1][1]["error"]["message"]


def hermes_chunks(text: str) -> list[dict]:
    """The chat path's chunks for `text`, fed a few characters at a time through its parser."""
    parser = MessageParser(None, HermesToolParser())
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    out = []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        delta = parser.feed(piece, final=final)
        if delta or final:
            out.append(chunk(delta, finish=("tool_calls" if parser.called else "stop")
                             if final else None))
    return out + [usage(10, 20)]


CALL_TEXT = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_a_model_s_own_tool_call_read_by_its_parser_is_a_function_call_item_and_a_tool_use():
    events, stream = run_response(hermes_chunks(CALL_TEXT))
    out = stream.response["output"]
    assert [i["type"] for i in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Sure. "
    assert out[1]["name"] == "get_weather" and json.loads(out[1]["arguments"]) == {"city": "Paris"}
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == out[1]["arguments"]

    messages = MessageStream("m", 10, None)
    for c in hermes_chunks(CALL_TEXT):
        messages.feed(c)
    messages.finish()
    content = messages.message["content"]
    assert [b["type"] for b in content] == ["text", "tool_use"]
    assert content[1]["input"] == {"city": "Paris"} and messages.message["stop_reason"] == "tool_use"


def test_input_images_become_image_parts_named_by_their_input_item():
    items = input_items([
        {"role": "user", "content": "first"},
        {"role": "user", "content": [{"type": "input_text", "text": "what is"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                                     {"type": "input_image", "image_url": "https://x.test/a.png",
                                      "detail": "auto"}]}])
    names: dict = {}
    messages = chat_messages(items, names, offset=2)  # after a system message and one turn
    assert messages[0] == {"role": "user", "content": "first"}
    assert messages[1]["content"] == [
        {"type": "text", "text": "what is"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png", "detail": "auto"}}]
    assert names == {"messages[3].content[1]": "input[1].content[1]",
                     "messages[3].content[2]": "input[1].content[2]"}
