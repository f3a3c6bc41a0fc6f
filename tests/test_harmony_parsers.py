"""The harmony parsers (`openai_gptoss` reasoning, `openai` tool calls) over hand-written gpt-oss
outputs, whole and streamed in random pieces and one character at a time (special tokens
split across deltas): the streamed deltas joined equal the output read in one piece, and no
delta shows a harmony tag."""
from __future__ import annotations

import pytest

from kvflow.entrypoints.openai.chat_output import MessageParser
from kvflow.entrypoints.openai.harmony import HarmonyReader, parse_header
from kvflow.entrypoints.openai.reasoning_parsers import (GptOssReasoningParser,
                                                         make_reasoning_parser, reasoning_token_ids)
from kvflow.entrypoints.openai.tool_parsers import make_tool_parser
from test_tool_parsers import calls, check_streamed_equals_whole

A = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"


def call(name: str, args: str, end: str = "<|call|>", recipient_first: bool = False) -> str:
    if recipient_first:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{args}{end}"
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{args}{end}")


def both(pass_calls: bool = True, tools: bool = True):
    def make():
        reasoning = make_reasoning_parser("openai_gptoss")
        reasoning.pass_calls = pass_calls and tools
        return MessageParser(reasoning, make_tool_parser("openai") if tools else None)
    return make


def read(make, text: str) -> dict:
    message = check_streamed_equals_whole(make, text)
    for key in ("content", "reasoning_content"):
        assert "<|" not in (message.get(key) or "")
    return message


CASES = [
    # (output, reasoning, content, calls)
    (A + "Think.<|end|>" + FINAL + "Hi there.<|return|>", "Think.", "Hi there.", []),
    (A + "Think.<|end|>" + FINAL + "Hi there.", "Think.", "Hi there.", []),  # stop token not in text
    (A + "Need weather.<|end|>" + call("get_weather", '{"city": "Paris"}'), "Need weather.", None,
     [("get_weather", {"city": "Paris"})]),
    (A + "Need weather.<|end|>" + call("get_weather", '{"city": "Paris"}', end=""), "Need weather.",
     None, [("get_weather", {"city": "Paris"})]),
    (A + "x<|end|>" + call("get_weather", '{"city": "<|P|>"}', recipient_first=True), "x", None,
     [("get_weather", {"city": "<|P|>"})]),
    (A + "two<|end|>" + call("a", '{"x": [1, {"y": "}"}]}') + call("b", "{}", recipient_first=True),
     "two", None, [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    (A + "only thinking, cut off", "only thinking, cut off", None, []),  # analysis without final
    (A + "hm<|end|><|start|>assistant<|chan", "hm", None, []),  # cut inside a header
    (A + "hm<|end|>" + FINAL + "Hi <", "hm", "Hi <", []),  # a lone "<" at the very end is text
    ("Plain text, no harmony at all.", None, "Plain text, no harmony at all.", []),
    ('{"city": "Paris"}', None, '{"city": "Paris"}', []),  # a constrained answer: no headers
    ("<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + call("f", "{}"), None,
     "Checking.", [("f", {})]),  # a preamble to the user, then a call
    (A + "look it up<|end|><|start|>assistant<|channel|>analysis to=browser.search code"
     "<|message|>{\"query\": \"x\"}<|call|>", "look it up", None, []),  # built-in tool: not a call
    (A + "a<|end|>" + call("f", ""), "a", None, [("f", {})]),  # no arguments
]


@pytest.mark.parametrize("text, reasoning, content, expected", CASES)
def test_harmony_reasoning_calls_and_content(text, reasoning, content, expected):
    message = read(both(), text)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content
    assert calls(message) == expected and message["called"] == bool(expected)


def test_a_call_cut_off_keeps_its_partial_arguments():
    message = read(both(), A + "x<|end|>" + call("f", '{"a": 1', end=""))
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1'}


def test_the_tool_parser_alone_drops_the_analysis():
    text = A + "Think.<|end|>" + FINAL + "Hi.<|return|>"
    message = read(lambda: MessageParser(None, make_tool_parser("openai")), text)
    assert message["content"] == "Hi." and "reasoning_content" not in message
    text = A + "Think.<|end|>" + call("f", '{"k": 1}')
    message = read(lambda: MessageParser(None, make_tool_parser("openai")), text)
    assert calls(message) == [("f", {"k": 1})] and message["content"] is None


def test_the_reasoning_parser_alone_drops_calls_and_never_shows_tags():
    text = A + "Think.<|end|>" + call("f", '{"k": 1}') + FINAL + "Done."
    message = read(both(tools=False), text)
    assert (message["reasoning_content"], message["content"]) == ("Think.", "Done.")


def test_tags_split_anywhere_are_held_until_decided():
    reader = HarmonyReader()
    events = []
    for piece in ["<|chan", "nel|>analy", "sis<|mess", "age|>Hm<", "|e", "nd|>"]:
        events += reader.feed(piece)
    events += reader.finish()
    assert [e[0] for e in events] == ["message", "text", "end"]
    assert events[0][1].channel == "analysis" and events[1] == ("text", "Hm")
    assert events[2] == ("end", "<|end|>")


@pytest.mark.parametrize("raw, expected", [
    ("<|channel|>analysis<|message|>", ("analysis", None, None, None)),
    ("<|start|>assistant<|channel|>final<|message|>", ("final", None, None, "assistant")),
    ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
     ("commentary", "functions.get_weather", "json", "assistant")),
    ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
     ("commentary", "functions.get_weather", "json", "assistant")),
    ("<|channel|>commentary to=functions.f<|message|>", ("commentary", "functions.f", None, None)),
])
def test_headers(raw, expected):
    h = parse_header(raw)
    assert (h.channel, h.recipient, h.content_type, h.role) == expected and h.raw == raw


def test_a_constraint_holds_from_the_first_token_under_harmony():
    assert reasoning_token_ids("openai_gptoss", lambda text: [1], "<|start|>assistant") == {}
    assert isinstance(make_reasoning_parser("openai_gptoss", "<|start|>assistant"),
                      GptOssReasoningParser)
    with pytest.raises(ValueError, match="reasoning_parser must be one of .*openai_gptoss"):
        make_reasoning_parser("gpt_oss")
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*openai"):
        make_tool_parser("harmony")


def test_a_required_tool_choice_reads_the_constrained_json_past_the_harmony_parser():
    """Under `openai_gptoss` a constraint holds from the first token: the output is the JSON
    array of `tool_choice: required` with no headers, content to the reasoning parser."""
    from kvflow.entrypoints.openai.tool_parsers import JsonArrayToolParser

    message = read(lambda: MessageParser(make_reasoning_parser("openai_gptoss"),
                                         JsonArrayToolParser()),
                   '[{"name": "f", "arguments": {"a": 1}}]')
    assert calls(message) == [("f", {"a": 1})] and "reasoning_content" not in message
