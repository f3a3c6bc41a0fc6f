"""gpt-oss's harmony format read as it streams: the output text, decoded with its special
tokens kept, split into messages, each with its header (channel, recipient, content type).

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|>

The first message has no `<|start|>assistant` (the prompt ends with it); the recipient may
also stand in the role part (`<|start|>assistant to=functions.NAME<|channel|>commentary json`).
A message ends at `<|end|>`, `<|return|>` or `<|call|>`, at the next header, or with the output
(the stop tokens `<|return|>` and `<|call|>` are often not in the text). Text outside any
header (a constrained answer, or a model that strays from the format) is a message without one.

Why not OpenAI's `openai-harmony` package: its `load_harmony_encoding(HARMONY_GPT_OSS)`
downloads the o200k_base vocabulary at run time (hash-checked; a local copy needs
TIKTOKEN_ENCODINGS_BASE), so it cannot start offline, and it parses token ids of that one
vocabulary. The format's grammar is a handful of tags, read here over the detokenizer's text
with any tokenizer that has them as special tokens (the server keeps them in the text:
`skip_special_tokens=False` under these parsers)."""
from __future__ import annotations

from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
MAX_HEADER = 512  # chars: a "header" longer than this never closes; its text is content


@dataclass(slots=True)
class Header:
    """One message's header; `raw` is its text as written, `<|message|>` included."""

    role: str | None = None
    channel: str | None = None
    recipient: str | None = None  # functions.NAME for a function call
    content_type: str | None = None  # json
    raw: str = ""


def parse_header(raw: str) -> Header:
    """`<|start|>ROLE [to=R]<|channel|>CHANNEL [to=R] [<|constrain|>TYPE | TYPE]<|message|>`,
    the role part left out when the header opens with `<|channel|>`."""
    body = raw[:-len(MESSAGE)] if raw.endswith(MESSAGE) else raw
    body = body[len(START):] if body.startswith(START) else body
    role_part, _, channel_part = body.partition(CHANNEL)
    channel_part, _, constrained = channel_part.partition(CONSTRAIN)
    header = Header(raw=raw)
    rest: list[str] = []
    for i, word in enumerate(role_part.split()):
        if word.startswith("to="):
            header.recipient = word[3:] or None
        elif i == 0:
            header.role = word
    for i, word in enumerate(channel_part.split()):
        if word.startswith("to="):
            header.recipient = header.recipient or word[3:] or None
        elif i == 0:
            header.channel = word
        else:
            rest.append(word)
    header.content_type = constrained.strip() or (rest[0] if rest else None)
    return header


def held_back(text: str) -> int:
    """Length of the longest suffix of `text` that may still grow into a tag."""
    for n in range(min(max(map(len, TAGS)) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(tag.startswith(tail) for tag in TAGS):
            return n
    return 0


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `tags` in `text`: (index, tag), or (-1, "")."""
    best = (-1, "")
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best[0] < 0 or at < best[0]):
            best = (at, tag)
    return best


class HarmonyReader:
    """Feed text deltas; get events `("message", Header)` (a message begins), `("text", str)`
    (more of its body) and `("end", tag)` (it ended, at `tag`; "" where the text just stopped
    or a new header began). `finish()` at the end of the output flushes what was held; an
    unfinished header is dropped (the output was cut inside it)."""

    def __init__(self) -> None:
        self.pending = ""
        self.state = "between"  # between | header | body

    def feed(self, text: str) -> list[tuple]:
        self.pending += text
        return self._parse(final=False)

    def finish(self) -> list[tuple]:
        return self._parse(final=True)

    def _parse(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while True:
            if self.state == "between":
                head = self.pending.lstrip()
                if not head or (not final and any(t.startswith(head) for t in (START, CHANNEL))):
                    self.pending = "" if final else head
                    return events
                self.pending = head
                if head.startswith((START, CHANNEL)):
                    self.state = "header"
                else:  # text outside the format: a message without a header
                    self.state = "body"
                    events.append(("message", Header()))
            if self.state == "header":
                at = self.pending.find(MESSAGE, 1)
                if at < 0:
                    if len(self.pending) <= MAX_HEADER and not final:
                        return events
                    if final and len(self.pending) <= MAX_HEADER:
                        self.pending = ""  # cut off inside the header
                        return events
                    # no header after all: its opening tag is text, and reading goes on past it
                    tag = START if self.pending.startswith(START) else CHANNEL
                    events += [("message", Header()), ("text", tag)]
                    self.pending, self.state = self.pending[len(tag):], "body"
                else:
                    end = at + len(MESSAGE)
                    raw, self.pending = self.pending[:end], self.pending[end:]
                    events.append(("message", parse_header(raw)))
                    self.state = "body"
                    continue
            # body: up to an end tag or the next header
            at, tag = _first(self.pending, (*ENDS, START, CHANNEL))
            if at < 0:
                keep = 0 if final else held_back(self.pending)
                text = self.pending[:len(self.pending) - keep]
                if text:
                    events.append(("text", text))
                self.pending = self.pending[len(text):]
                if final:
                    events.append(("end", ""))
                    self.state = "between"
                return events
            if at:
                events.append(("text", self.pending[:at]))
            if tag in ENDS:
                self.pending = self.pending[at + len(tag):]
                events.append(("end", tag))
            else:  # a new header without an end tag before it
                self.pending = self.pending[at:]
                events.append(("end", ""))
            self.state = "between"
