"""Tool-call and reasoning parsers over hand-written model outputs, whole and streamed in
random-size pieces: the streamed deltas joined equal the output read in one piece."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from kvflow.entrypoints.openai.chat_output import MessageParser, merge_delta
from kvflow.entrypoints.openai.reasoning_parsers import (REASONING_PARSERS,
                                                         make_reasoning_parser)
from kvflow.entrypoints.openai.server_settings import ServerSettings
from kvflow.entrypoints.openai.tool_parsers import (TOOL_PARSERS, JsonArrayToolParser,
                                                    NamedToolParser, make_tool_parser)
from kvflow.entrypoints.openai.tool_schema import named_tool_schema, required_tools_schema


def read(parser: MessageParser, text: str, pieces: list[str] | None = None) -> dict:
    """The message the deltas make, feeding `pieces` (default: the whole text at once)."""
    pieces = pieces if pieces is not None else [text]
    message: dict = {"content": None}
    for i, piece in enumerate(pieces):
        merge_delta(message, parser.feed(piece, final=i == len(pieces) - 1))
    for call in message.get("tool_calls", ()):
        assert call["id"].startswith("call_") and call["type"] == "function"
        call.pop("id")
    message["called"] = parser.called
    return message


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_streamed_equals_whole(make, text: str) -> dict:
    whole = read(make(), text)
    rng = random.Random(text)
    for _ in range(30):
        assert read(make(), text, random_pieces(text, rng)) == whole
    assert read(make(), text, list(text) + [""]) == whole  # one character at a time
    return whole


def calls(message: dict) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", ())]


HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>', None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>'
     '\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ('{"arguments": {"q": "x \\" <tool_call>"}, "name": "search"}', '{"arguments": {"q": "x \\" <tool_call>"}, "name": "search"}', []),
    ('<tool_call>{"arguments": {"q": "esc\\"aped"}, "name": "search"}</tool_call> done',
     "done", [("search", {"q": 'esc"aped'})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("f", {"k": 1})]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    ("no tools here, just < and <tool and </tool_call>", "no tools here, just < and <tool and </tool_call>", []),
    ('<tool_call>not json</tool_call>', '<tool_call>not json</tool_call>', []),
    ('<tool_call>{"name": "cut", "arguments": {"a": 1', None, []),  # checked below
]


@pytest.mark.parametrize("text, content, expected", HERMES)
def test_hermes_calls_and_content(text, content, expected):
    message = check_streamed_equals_whole(lambda: MessageParser(None, make_tool_parser("hermes")), text)
    if text.endswith('"a": 1'):  # cut off by max_tokens: the call is there, its arguments partial
        assert message["tool_calls"][0]["function"] == {"name": "cut", "arguments": '{"a": 1'}
        return
    assert calls(message) == expected
    assert message["content"] == content
    assert message["called"] == bool(expected)


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"s": "x;y"}}',
     None, [("a", {"n": 1}), ("b", {"s": "x;y"})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    ('  {"name": "f", "parameters": {"deep": {"a": [[], {}]}}}  ', None, [("f", {"deep": {"a": [[], {}]}})]),
]


@pytest.mark.parametrize("text, content, expected", LLAMA3)
def test_llama3_json_calls_and_content(text, content, expected):
    message = check_streamed_equals_whole(
        lambda: MessageParser(None, make_tool_parser("llama3_json")), text)
    assert calls(message) == expected
    assert message["content"] == content


def test_auto_mode_without_parallel_tool_calls_keeps_the_first_call():
    text = '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"s": "x"}}'
    message = check_streamed_equals_whole(
        lambda: MessageParser(None, make_tool_parser("llama3_json"), max_calls=1), text)
    assert calls(message) == [("a", {"n": 1})] and message["called"]


def test_required_array_and_named_choice():
    text = ' [ {"name": "a", "arguments": {"x": 1}} , {"name": "b", "arguments": {"y": ["]"]}} ] '
    message = check_streamed_equals_whole(lambda: MessageParser(None, JsonArrayToolParser()), text)
    assert calls(message) == [("a", {"x": 1}), ("b", {"y": ["]"]})] and message["content"] is None
    message = check_streamed_equals_whole(lambda: MessageParser(None, NamedToolParser("f")),
                                          '{"city": "Paris"}')
    assert calls(message) == [("f", {"city": "Paris"})] and message["called"]


def test_streamed_call_sends_name_first_then_argument_fragments():
    parser = MessageParser(None, make_tool_parser("hermes"))
    deltas = [parser.feed(p, final=False) for p in
              ["<tool_", 'call>{"name": "f", ', '"arguments": {"a"', ': 1}}</tool_call>']]
    deltas.append(parser.feed("", final=True))
    assert deltas[0] == {} and deltas[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert "id" in deltas[1]["tool_calls"][0]
    fragments = [c["function"]["arguments"] for d in deltas[2:] for c in d.get("tool_calls", ())]
    assert fragments == ['{"a"', ": 1}"]
    assert all("id" not in c for d in deltas[2:] for c in d.get("tool_calls", ()))


REASONING = [
    ("qwen3", "<think>\nstep 1\nstep 2\n</think>\n\nParis.", "\nstep 1\nstep 2\n", "Paris."),
    ("qwen3", "Paris, without thinking.", None, "Paris, without thinking."),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "hmm </think> Paris.", "hmm ", "Paris."),
    ("deepseek_r1", "<think>hmm</think>Paris.", "hmm", "Paris."),
    ("deepseek_r1", "only thinking", "only thinking", None),
]


@pytest.mark.parametrize("name, text, reasoning, content", REASONING)
def test_reasoning_split_from_content(name, text, reasoning, content):
    message = check_streamed_equals_whole(lambda: MessageParser(make_reasoning_parser(name), None), text)
    assert message.get("reasoning_content") == reasoning and message["content"] == content


def test_reasoning_then_a_tool_call():
    text = '<think>I should call f.</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    message = check_streamed_equals_whole(
        lambda: MessageParser(make_reasoning_parser("qwen3"), make_tool_parser("hermes")), text)
    assert message["reasoning_content"] == "I should call f."
    assert calls(message) == [("f", {"a": 1})] and message["content"] is None


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}},
        "required": ["guest"],
        "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}},
                            "required": ["name"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
]


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_tools_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}},
          {"name": "book", "arguments": {"guest": {"name": "Ada"}}},
          {"name": "ping", "arguments": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "book", "arguments": {"guest": {}}}],
                [{"name": "nope", "arguments": {}}], [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["arguments"]
    single = required_tools_schema(TOOLS, parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)
    jsonschema.validate(ok[:1], single)


def test_named_schema_is_the_tools_parameters():
    assert named_tool_schema(TOOLS, "get_weather") == TOOLS[0]["function"]["parameters"]
    assert named_tool_schema(TOOLS, "ping") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="tool_choice: no tool named 'nope'"):
        named_tool_schema(TOOLS, "nope")


def test_conflicting_defs_are_refused():
    a = {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"X": {"type": "string"}}}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"X": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="\\$defs 'X'"):
        required_tools_schema([a, b])


def test_server_options_offer_every_parser():
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(ServerSettings)}
    assert fields["tool_call_parser"].metadata["choices"] == tuple(TOOL_PARSERS)
    assert fields["reasoning_parser"].metadata["choices"] == tuple(REASONING_PARSERS)


def test_conversation_hands_templates_tool_calls_with_object_arguments():
    from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
    from kvflow.entrypoints.openai.serving_chat import conversation, tool_dicts

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": TOOLS[:1]})
    convo = conversation(req.messages)
    assert convo[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert convo[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert tool_dicts(req.tools) == TOOLS[:1]


@pytest.mark.parametrize("name,prompt,output,expected", [
    ("deepseek_r1", "Assistant: <think>\nok</think>\n", "The answer is 4.", ("", "The answer is 4.")),
    ("qwen3", "assistant\n<think>\n", "hmm</think>\n\nOK", ("hmm", "OK")),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "<think>x</think>OK", ("", "<think>x</think>OK")),
    ("qwen3", "assistant\n", "<think>hmm</think>OK", ("hmm", "OK")),
    ("qwen3", "assistant\n", "OK", ("", "OK")),
    ("deepseek_r1", "Assistant:", "hmm</think>OK", ("hmm", "OK")),
])
def test_the_parser_and_the_constraint_gate_read_the_prompt_alike(name, prompt, output, expected):
    """Where the output begins (inside the reasoning or not) is decided once, from the rendered
    prompt, for both the text split and the grammar's gate (reasoning_token_ids)."""
    from kvflow.entrypoints.openai.reasoning_parsers import reasoning_token_ids

    assert make_reasoning_parser(name, prompt).feed(output, final=True) == expected
    gate = reasoning_token_ids(name, {"<think>": [1], "</think>": [2]}.__getitem__, prompt)
    if prompt.rstrip().endswith("</think>"):
        assert gate == {}  # the prompt closed the reasoning: constrained from the first token
    else:
        assert gate["reasoning_end_token_ids"] == [2]
