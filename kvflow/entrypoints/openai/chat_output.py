"""One chat choice's text turned into OpenAI message deltas: reasoning (`--reasoning-parser`)
first, then tool calls (`--tool-call-parser`, or the JSON of a required / named tool_choice),
the rest content. Streamed and non-streamed responses are both made of these deltas."""
from __future__ import annotations

import uuid

from kvflow.entrypoints.openai.reasoning_parsers import ReasoningParser
from kvflow.entrypoints.openai.tool_parsers import ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class MessageParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 max_calls: int | None = None) -> None:
        """`max_calls`: calls past this many are dropped (1 for `parallel_tool_calls: false`
        under tool_choice "auto", where no grammar holds the model to one call)."""
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls

    @property
    def called(self) -> bool:
        """Some tool call was made: the choice finishes with "tool_calls"."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str, final: bool) -> dict:
        """The delta (`reasoning_content`, `content`, `tool_calls`) for `text`; may be empty.
        `final=True` on the choice's last output flushes whatever was held back."""
        delta: dict = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                delta["content"] = content
            return delta
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        text_out = "".join(e[1] for e in events if e[0] == "content")
        if text_out:
            delta["content"] = text_out
        calls: list[dict] = []
        for event in events:
            if event[0] in ("call", "args") and self.max_calls is not None and event[1] >= self.max_calls:
                continue
            if event[0] == "call":
                calls.append({"index": event[1], "id": tool_call_id(), "type": "function",
                              "function": {"name": event[2], "arguments": ""}})
            elif event[0] == "args":
                if calls and calls[-1]["index"] == event[1]:
                    calls[-1]["function"]["arguments"] += event[2]
                else:
                    calls.append({"index": event[1], "function": {"arguments": event[2]}})
        if calls:
            delta["tool_calls"] = calls
        return delta


def merge_delta(message: dict, delta: dict) -> None:
    """Join a delta into a non-streamed `message` (content, reasoning_content, tool_calls)."""
    if delta.get("content"):
        message["content"] = (message.get("content") or "") + delta["content"]
    if delta.get("reasoning_content"):
        message["reasoning_content"] = (message.get("reasoning_content") or "") + \
            delta["reasoning_content"]
    for call in delta.get("tool_calls") or ():
        calls = message.setdefault("tool_calls", [])
        if call["index"] == len(calls):
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": call["function"].get("name"), "arguments": ""}})
        calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
