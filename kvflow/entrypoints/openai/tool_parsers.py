"""Tool calls read out of a model's text as it streams: `--tool-call-parser` (the model's own
format, for `tool_choice="auto"`) and the JSON that `required` / a named `tool_choice`
constrain the output to.

A parser is fed text deltas and returns events: `("content", text)`, `("call", index, name)`
(a call begins; its name is known) and `("args", index, fragment)` (more of the call's
`arguments`, a JSON text). The arguments are the model's own JSON text, passed through as it
arrives, so the fragments joined are exactly what a non-streamed reading gives. Text that may
still turn into a tag is held back until it is decided; `finish()` flushes it."""
from __future__ import annotations

import json

from kvflow.entrypoints.openai.harmony import HarmonyReader

ARGS_KEYS = ("arguments", "parameters")
CALL_KEYS = ("name", *ARGS_KEYS)


class _CallScanner:
    """One call's JSON object, `{"name": ..., "arguments": {...}}`, scanned incrementally.
    A call begins once its name is known; the arguments object streams raw after that."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.raw = ""
        self.pos = 0
        self.depth = 0
        self.in_string = self.escape = False
        self.state = "start"  # start | key | colon | value_start | value
        self.key_start = 0
        self.key: str | None = None
        self.value_start = 0
        self.value_kind = ""  # string | container | scalar
        self.values: dict[str, str] = {}  # complete top-level values, raw
        self.name: str | None = None
        self.started = self.args_done = self.done = self.failed = False
        self.args_key: str | None = None
        self.args_sent = 0

    def feed(self, text: str) -> tuple[list[tuple], str]:
        """Events, and the text after the object once it is closed (or all of it on failure)."""
        start = len(self.raw)
        self.raw += text
        for i in range(start, len(self.raw)):
            self._step(i, self.raw[i])
            if self.done or self.failed:
                leftover = self.raw[i + 1:]
                self.raw = self.raw[:i + 1]
                return self._events(), leftover
        return self._events(), ""

    def _step(self, i: int, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.state == "key":
                    self.key = json.loads(self.raw[self.key_start:i + 1])
                    if not self.values and self.key not in CALL_KEYS:
                        self.failed = True  # some other JSON object: not a call
                    self.state = "colon"
                elif self.depth == 1 and self.state == "value":
                    self._value_end(i + 1)
            return
        if self.state == "value" and self.value_kind == "scalar" and (ch in ",}" or ch.isspace()):
            self._value_end(i)
        if ch.isspace():
            return
        if self.state == "start":
            if ch != "{":
                self.failed = True
            self.depth, self.state = 1, "key"
        elif self.state == "key":
            if ch == '"':
                self.in_string, self.key_start = True, i
            elif ch == "}":
                self.depth, self.done = 0, True
            elif ch != ",":
                self.failed = True
        elif self.state == "colon":
            if ch != ":":
                self.failed = True
            self.state = "value_start"
        elif self.state == "value_start":
            self.state, self.value_start = "value", i
            if ch == '"':
                self.value_kind, self.in_string = "string", True
            elif ch in "{[":
                self.value_kind, self.depth = "container", 2
            else:
                self.value_kind = "scalar"
        elif self.state == "value" and self.value_kind == "container":
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end(i + 1)

    def _value_end(self, end: int) -> None:
        self.values.setdefault(self.key, self.raw[self.value_start:end])
        if self.key in ARGS_KEYS and self.args_key is None:
            self.args_key = self.key
        self.state = "key"

    def _events(self) -> list[tuple]:
        events: list[tuple] = []
        if self.name is None and "name" in self.values:
            try:
                name = json.loads(self.values["name"])
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
        if self.name is not None and not self.started:
            self.started = True
            events.append(("call", self.index, self.name))
        if not self.started or self.args_done:
            return events
        if self.args_key is not None:  # the arguments are complete
            raw = self.values[self.args_key]
            if raw[:1] in "{[":
                fragment = raw[self.args_sent:]
            elif raw[:1] == '"':  # arguments given as a JSON string: its text is the JSON
                fragment = json.loads(raw)
            else:
                fragment = raw
            self.args_done = True
        elif (self.state == "value" and self.key in ARGS_KEYS and self.value_kind == "container"
              and self.key not in self.values):
            fragment = self.raw[self.value_start + self.args_sent:]
        elif self.done or self.failed:
            fragment, self.args_done = ("{}" if not self.args_sent else ""), True
        else:
            fragment = ""
        if fragment:
            self.args_sent += len(fragment)
            events.append(("args", self.index, fragment))
        return events


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """Feed text deltas, get events; `finish()` at the end of the output."""

    def __init__(self) -> None:
        self.pending = ""
        self.index = 0  # of the next call
        self.called = False  # some call began

    def feed(self, text: str) -> list[tuple]:
        self.pending += text
        events = self._parse(final=False)
        self.called = self.called or any(e[0] == "call" for e in events)
        return events

    def finish(self) -> list[tuple]:
        events = self._parse(final=True)
        self.called = self.called or any(e[0] == "call" for e in events)
        return events

    def _parse(self, final: bool) -> list[tuple]:
        raise NotImplementedError


class _ScanningParser(ToolParser):
    """Shared by the formats: runs a `_CallScanner` over `self.pending` while in a call."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner: _CallScanner | None = None

    def _scan(self, events: list[tuple]) -> bool:
        """Feed pending text to the open call; True when the call is over (done or failed)."""
        new, leftover = self.scanner.feed(self.pending)
        self.pending = leftover
        events.extend(new)
        if self.scanner.done or self.scanner.failed:
            if self.scanner.started:
                self.index += 1
            return True
        return False


class HermesToolParser(_ScanningParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3); text
    outside the tags is content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"  # text | call | closing
        self.after_call = False  # the blank space after a call is not content

    def _parse(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while True:
            if self.state == "text":
                if self.after_call:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return events
                    self.after_call = False
                at = self.pending.find(self.START)
                if at >= 0:
                    if at:
                        events.append(("content", self.pending[:at]))
                    self.pending = self.pending[at + len(self.START):]
                    self.state, self.scanner = "call", _CallScanner(self.index)
                    continue
                keep = 0 if final else held_back(self.pending, self.START)
                text = self.pending[:len(self.pending) - keep]
                if text:
                    events.append(("content", text))
                self.pending = self.pending[len(text):]
                return events
            if self.state == "call":
                if not self._scan(events):
                    if final and not self.scanner.started:  # an unfinished non-call
                        events.append(("content", self.START + self.scanner.raw))
                    return events
                if self.scanner.failed and not self.scanner.started:  # not a call after all
                    events.append(("content", self.START))
                    self.pending = self.scanner.raw + self.pending
                    self.state = "text"
                    continue
                self.state = "closing"
            if self.state == "closing":  # whatever lies between the object and the end tag
                at = self.pending.find(self.END)
                if at < 0:
                    self.pending = self.pending[len(self.pending) - held_back(self.pending, self.END):]
                    return events
                self.pending = self.pending[at + len(self.END):]
                self.state, self.after_call = "text", True


class Llama3JsonToolParser(_ScanningParser):
    """Llama 3.x's JSON calls: the output is `{"name": ..., "parameters": {...}}` (after an
    optional `<|python_tag|>`), several separated by `;`. Output that does not begin with a
    call is all content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | call | between | content

    def _parse(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while True:
            if self.state == "start":
                text = self.pending.lstrip()
                if text.startswith(self.TAG):
                    text = text[len(self.TAG):].lstrip()
                if text.startswith("{"):
                    self.pending, self.state = text, "call"
                    self.scanner = _CallScanner(self.index)
                elif not final and (not text or self.TAG.startswith(text)):
                    return events
                else:
                    self.state = "content"
            if self.state == "call":
                if not self._scan(events):
                    if final and not self.scanner.started:
                        events.append(("content", self.scanner.raw))
                    return events
                if self.scanner.failed and not self.scanner.started:
                    self.pending = self.scanner.raw + self.pending
                    self.state = "content"
                else:
                    self.state = "between"
            if self.state == "between":
                text = self.pending.lstrip().lstrip(";").lstrip()
                if text.startswith("{"):
                    self.pending, self.state = text, "call"
                    self.scanner = _CallScanner(self.index)
                    continue
                if not text and not final:
                    self.pending = ""
                    return events
                self.pending, self.state = text, "content"
            if self.state == "content":
                if self.pending:
                    events.append(("content", self.pending))
                self.pending = ""
                return events


class JsonArrayToolParser(_ScanningParser):
    """What `tool_choice="required"` constrains the output to: `[{"name": ..., "arguments":
    {...}}, ...]`."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "open"  # open | between | call | closed

    def _parse(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while True:
            if self.state == "call":
                if not self._scan(events):
                    return events
                self.state = "between"
            text = self.pending.lstrip()
            if self.state == "open" and text.startswith("["):
                text, self.state = text[1:], "between"
            if self.state == "between":
                text = text.lstrip(", \n\t\r")
                if text.startswith("{"):
                    self.pending, self.state = text, "call"
                    self.scanner = _CallScanner(self.index)
                    continue
                if text.startswith("]"):
                    self.state = "closed"
            self.pending = "" if self.state != "open" else text
            return events


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the whole output is that function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.sent = False

    def _parse(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        if not self.sent and (self.pending or final):
            events.append(("call", 0, self.name))
            self.sent = True
        if self.pending:
            events.append(("args", 0, self.pending))
            self.pending = ""
        return events


class OpenAIToolParser(ToolParser):
    """gpt-oss's harmony calls (harmony.py): a message to `functions.NAME` is a call of NAME,
    its body the arguments (JSON text, passed through as it streams). Final and commentary
    text without a recipient is content; analysis, and messages to other recipients (the
    built-in browser and python tools), are not."""

    PREFIX = "functions."

    def __init__(self) -> None:
        super().__init__()
        self.reader = HarmonyReader()
        self.kind = "content"  # of the current message: content | call | drop
        self.args_sent = False

    def _parse(self, final: bool) -> list[tuple]:
        text, self.pending = self.pending, ""
        raw = self.reader.feed(text) if text else []
        if final:
            raw += self.reader.finish()
        events: list[tuple] = []
        for event in raw:
            if event[0] == "message":
                header = event[1]
                if header.recipient is not None and header.recipient.startswith(self.PREFIX) \
                        and len(header.recipient) > len(self.PREFIX):
                    self.kind, self.args_sent = "call", False
                    events.append(("call", self.index, header.recipient[len(self.PREFIX):]))
                elif header.recipient is not None or header.channel == "analysis":
                    self.kind = "drop"
                else:
                    self.kind = "content"
            elif event[0] == "text":
                if self.kind == "call":
                    fragment = event[1].lstrip() if not self.args_sent else event[1]
                    if fragment:
                        self.args_sent = True
                        events.append(("args", self.index, fragment))
                elif self.kind == "content":
                    events.append(("content", event[1]))
            elif self.kind == "call":  # the call's end
                if not self.args_sent:
                    events.append(("args", self.index, "{}"))
                self.index += 1
                self.kind = "content"
        return events


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                "openai": OpenAIToolParser}


def make_tool_parser(name: str) -> ToolParser:
    """The `--tool-call-parser` named `name`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()
