"""`--reasoning-parser`: a thinking model's `<think>...</think>` split from its answer, as it
streams (`reasoning_content` apart from `content`).

`deepseek_r1`: the output is reasoning from its start (the chat template opened the `<think>`;
a `<think>` the model writes itself is dropped) up to `</think>`. `qwen3`: the output is
reasoning only when it begins with `<think>` (Qwen3 writes it; with thinking switched off
there is none), else all content. Text that may still become a tag is held back.

`openai_gptoss`: gpt-oss's harmony messages (harmony.py): the analysis channel is reasoning,
the final channel (and commentary meant for the user) content."""
from __future__ import annotations

from kvflow.entrypoints.openai.harmony import HarmonyReader
from kvflow.entrypoints.openai.tool_parsers import held_back


class ReasoningParser:
    START, END = "<think>", "</think>"
    starts_in_reasoning = False
    think_tags = True  # the prompt and the constraint's gate follow <think> and </think>

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        """`starts_in_reasoning`: what the rendered prompt decided (`prompt_starts_in_reasoning`):
        False, the prompt closed the reasoning (all content); True, it opened it; None: the
        parser's own rule."""
        if starts_in_reasoning is not None:
            self.starts_in_reasoning = starts_in_reasoning
        self.state = "content" if starts_in_reasoning is False else "start"  # | reasoning | gap
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) decided by this delta; `final=True` flushes what was held."""
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(self.START):
                self.pending, self.state = head[len(self.START):], "reasoning"
            elif self.START.startswith(head) and not final:
                return "", ""  # may still be the tag
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "content"
        if self.state == "reasoning":
            at = self.pending.find(self.END)
            if at < 0:
                keep = 0 if final else held_back(self.pending, self.END)
                reasoning = self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(reasoning):]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(self.END):]
            self.state = "gap"
        if self.state == "gap":  # the blank lines between the reasoning and the answer
            self.pending = self.pending.lstrip()
            if not self.pending:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class GptOssReasoningParser(ReasoningParser):
    """Harmony: analysis is reasoning; final, commentary without a recipient and text outside
    the format are content. A message to a recipient (a tool call) is dropped, or, with
    `pass_calls` (the `openai` tool parser reads the content next), handed on as content in
    its harmony text, header and end tag included."""

    think_tags = False

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        super().__init__(starts_in_reasoning)
        self.reader = HarmonyReader()
        self.pass_calls = False
        self.kind = "content"  # of the current message: reasoning | content | call | drop

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        events = self.reader.feed(text) if text else []
        if final:
            events += self.reader.finish()
        reasoning, content = [], []
        for event in events:
            if event[0] == "message":
                header = event[1]
                if header.recipient is not None:
                    self.kind = "call" if self.pass_calls else "drop"
                    if self.pass_calls:
                        content.append(header.raw)
                else:
                    self.kind = "reasoning" if header.channel == "analysis" else "content"
            elif event[0] == "text":
                if self.kind == "reasoning":
                    reasoning.append(event[1])
                elif self.kind != "drop":
                    content.append(event[1])
            elif self.kind == "call":  # its end: the tool parser closes the call here
                content.append("<|call|>")
        return "".join(reasoning), "".join(content)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
                     "openai_gptoss": GptOssReasoningParser}


def prompt_starts_in_reasoning(name: str, prompt: str) -> bool | None:
    """Whether the output of a prompt rendered as `prompt` begins inside the reasoning: False
    when the prompt already closed it (Qwen3's template with thinking off ends in
    `<think>\n\n</think>\n\n`), True when it opened it (ends in `<think>`) or the parser
    always starts there (deepseek_r1), None when the output decides (qwen3: it reasons only if
    it begins with `<think>`). The parser that splits the text and the constraint's gate both
    follow this one answer. Harmony's prompt says nothing of it: None."""
    cls = REASONING_PARSERS[name]
    if not cls.think_tags:
        return None
    tail = prompt.rstrip()
    if tail.endswith(cls.END):
        return False
    if tail.endswith(cls.START) or cls.starts_in_reasoning:
        return True
    return None


def reasoning_token_ids(name: str, encode, prompt: str) -> dict:
    """What a constraint needs to apply only after the reasoning (StructuredOutputsParams'
    `reasoning_end_token_ids` and `reasoning_start_token_ids`), for this parser, a tokenizer's
    `encode(text)` (no special tokens) and the rendered prompt; {} when the constraint holds
    from the first output token.

    A prompt that already closed the reasoning (Qwen3's template with thinking off ends in
    `<think>\n\n</think>\n\n`) has none to wait for; one that opened it (ends in `<think>`)
    starts in reasoning, as deepseek_r1 always does. Otherwise, qwen3 reasons only when its
    output begins with `<think>`: a tokenizer without a one-token `<think>` is not a thinking
    one, and its output is constrained from the start.

    openai_gptoss: none; a constraint holds from the first token, so a constrained gpt-oss
    answer is the constrained text itself, without analysis (vLLM instead lets it reason
    first and constrains the final channel)."""
    cls = REASONING_PARSERS[name]
    if not cls.think_tags:
        return {}
    starts = prompt_starts_in_reasoning(name, prompt)
    if starts is False:
        return {}
    end = encode(cls.END)
    if not end:
        return {}
    if starts:
        return {"reasoning_end_token_ids": end}
    start = encode(cls.START)
    if len(start) != 1:
        return {}
    return {"reasoning_end_token_ids": end, "reasoning_start_token_ids": start}


def make_reasoning_parser(name: str, prompt: str | None = None) -> ReasoningParser:
    """The parser `name`, told by the rendered `prompt` (when given) where the output begins."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
    starts = None if prompt is None else prompt_starts_in_reasoning(name, prompt)
    return REASONING_PARSERS[name](starts)
