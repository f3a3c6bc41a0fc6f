"""`kvflow generate --explain`: a small scripted run of the real engine (three requests of
different lengths arriving at different steps, a small budget, small blocks), printed as the
step table with one plain sentence per step saying what the scheduler decided and why."""
from __future__ import annotations

import os
import string
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.sampling_params import SamplingParams
from kvflow.trace.narrate import Before, narrate, snapshot
from kvflow.trace.reader import load_trace
from kvflow.trace.table import HEADER, align, column_widths, text_lines

# Real text, so the tokens (and what the model makes of them) are real; cut or repeated to length.
TEXTS = [
    "The printing press spread across Europe within fifty years, and books became cheap enough "
    "for merchants, students and craftsmen to own.",
    "Write a short poem about autumn leaves falling on a quiet river.",
    "Explain in simple words why the sky looks blue during the day.",
    "List three things every new programmer should learn first.",
]


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


@dataclass
class Scenario:
    """Requests A, B, C, ...: prompt length, the step it arrives at and how many tokens it makes."""

    budget: int = 16
    block_size: int = 4
    num_blocks: int = 8
    prompts: list[int] = field(default_factory=lambda: [20, 7, 12])
    arrivals: list[int] = field(default_factory=lambda: [0, 2, 5])
    max_tokens: list[int] = field(default_factory=lambda: [6, 4, 5])

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.max_tokens) == 1:
            self.max_tokens = self.max_tokens * n
        if not 1 <= n <= 26:
            raise ValueError(f"--explain-prompts needs 1 to 26 requests, got {n}")
        if len(self.arrivals) != n or len(self.max_tokens) != n:
            raise ValueError(f"{n} prompts but {len(self.arrivals)} arrivals and "
                             f"{len(self.max_tokens)} max-tokens values: give one of each per request")
        for what, v in (("budget", self.budget), ("block size", self.block_size),
                        ("number of blocks", self.num_blocks)):
            if v <= 0:
                raise ValueError(f"the {what} must be positive, got {v}")
        if min(self.prompts) <= 0 or min(self.max_tokens) <= 0 or min(self.arrivals) < 0:
            raise ValueError("prompt lengths and max tokens must be positive, arrivals >= 0")
        for name, p, m in zip(self.names, self.prompts, self.max_tokens):
            need = -(-(p + m) // self.block_size)
            if need > self.num_blocks:
                raise ValueError(f"request {name} needs {need} blocks ({p}+{m} tokens in blocks of "
                                 f"{self.block_size}) but the pool has {self.num_blocks}")

    @property
    def names(self) -> list[str]:
        return list(string.ascii_uppercase[:len(self.prompts)])


def prompt_ids(tokenizer, length: int, index: int) -> list[int]:
    base = tokenizer.encode(TEXTS[index % len(TEXTS)], add_special_tokens=False)
    return (base * (length // len(base) + 1))[:length]


@dataclass
class ExplainRun:
    scenario: Scenario
    trace_path: str
    befores: dict[int, Before]
    texts: dict[str, str]
    token_text: object  # int -> str


def run_scenario(sc: Scenario, make_engine: Callable, trace_path: str) -> ExplainRun:
    """Drive the real engine through the scenario, one step at a time, writing the trace.
    `make_engine(**options)` returns an LLMEngine built with the caller's engine options and
    these scenario ones."""
    engine = make_engine(max_num_batched_tokens=sc.budget, block_size=sc.block_size,
                         num_blocks=sc.num_blocks, trace=trace_path)
    tok = engine.tokenizer
    sched = engine.core.scheduler
    arrivals = sorted(zip(sc.arrivals, range(len(sc.names))))
    befores: dict[int, Before] = {}
    texts: dict[str, str] = {}
    tick = 0
    while arrivals or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[0][0] > tick:
            tick = arrivals[0][0]  # nothing to run until the next arrival: skip the idle steps
        arrived = []
        while arrivals and arrivals[0][0] <= tick:
            _, i = arrivals.pop(0)
            name = sc.names[i]
            params = SamplingParams(max_tokens=sc.max_tokens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(name, prompt_ids(tok, sc.prompts[i], i), params)
            arrived.append(name)
        step = sched.step_index
        before = snapshot(sched, arrived)
        for out in engine.step():
            if out.finished:
                before.finish_reasons[out.request_id] = out.outputs[0].finish_reason
                texts[out.request_id] = out.outputs[0].text
        befores[step] = before
        tick += 1
    engine.shutdown()
    return ExplainRun(sc, trace_path, befores, texts, lambda t: tok.decode([t]))


def render(run: ExplainRun) -> str:
    """Intro, then each step's table rows followed by its sentence, then what each request made."""
    sc = run.scenario
    out = [f"A scripted run of the real engine: {len(sc.names)} requests, a budget of {sc.budget} "
           f"tokens per step, blocks of {sc.block_size} tokens, {sc.num_blocks} blocks in the pool "
           f"({sc.num_blocks * sc.block_size} tokens of KV cache).", ""]
    for name, p, a, m in zip(sc.names, sc.prompts, sc.arrivals, sc.max_tokens):
        out.append(f"  {name}: {p}-token prompt, arrives at step {a}, generates {m} tokens")
    out.append("")
    steps = load_trace(run.trace_path).steps
    per_step = [text_lines(s, run.token_text) for s in steps]
    widths = column_widths([list(HEADER)] + [row for rows in per_step for row in rows])
    width = max(100, sum(widths) + 2 * len(widths))
    out += align([list(HEADER)], widths)
    for s, rows in zip(steps, per_step):
        out += align(rows, widths)
        before = run.befores.get(s.step)
        if before is not None:
            out += textwrap.wrap(narrate(s, before), width, initial_indent="      -> ",
                                 subsequent_indent="         ")
        out.append("")
    out.append("What each request generated (greedy, end-of-sequence ignored):")
    for name in sc.names:
        out.append(f"  {name}: {run.texts.get(name, '')!r}")
    return "\n".join(out) + "\n"


def explain(sc: Scenario, make_engine: Callable, trace_path: str | None = None) -> str:
    """Run the scenario on `make_engine(**scenario_options)` (see run_scenario) and return the
    explained table; keeps the trace at `trace_path` if given."""
    if trace_path:
        return render(run_scenario(sc, make_engine, trace_path))
    with tempfile.TemporaryDirectory(prefix="kvflow-explain-") as tmp:
        return render(run_scenario(sc, make_engine, os.path.join(tmp, "trace.jsonl")))
