"""Structured outputs in the engine: grammars compile off the loop (the scheduler passes a
request over while `waiting_for_grammar`), each step's constrained rows get their mask before
sampling, the matcher advances once per token, and a finished grammar ends the request with
`stop`. The unit tests use fakes; the slow ones run every constraint kind through `LLM` with
the default model."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from kvflow.model.sampler import (Sampler, SamplingRow, apply_grammar_bitmask,
                                  build_sampling_metadata)
from kvflow.request import FinishReason, RequestStatus
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams as SO
from kvflow.structured import StructuredOutputManager, validate_structured_outputs

from core_helpers import FakeRunner, make_request, make_scheduler


# -- fakes ----------------------------------------------------------------------------------------
class FakeConstraint:
    """What the scheduler sees of a StructuredOutputRequest: ready when told, then a matcher
    that accepts anything and terminates after `length` tokens."""

    def __init__(self, ready=False, length=3, error=None) -> None:
        self.ready, self.length, self.error = ready, length, error
        self.accepted: list[int] = []
        self.closed = False

    def is_ready(self) -> bool:
        return self.ready

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def close(self) -> None:
        self.closed = True


def constrained(rid, prompt_len=8, max_tokens=8, **kw):
    req = make_request(rid, prompt_len, max_tokens)
    req.structured_output = FakeConstraint(**kw)
    return req


def step(sched, runner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


# -- the scheduler --------------------------------------------------------------------------------
def test_a_compiling_request_is_skipped_and_never_blocks_the_queue():
    sched, runner = make_scheduler(), FakeRunner()
    a = constrained("a")
    sched.add_request(a)
    sched.add_request(make_request("b", 8))
    assert a.status == RequestStatus.WAITING_FOR_GRAMMAR
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["b"]  # b, behind a in the queue, runs
    assert out.waiting_for_grammar_ids == ["a"]
    assert a.num_computed_tokens == 0 and sched.kv_cache_manager.get_block_ids("a") == []
    a.structured_output.ready = True
    out, _ = step(sched, runner)
    assert "a" in out.num_scheduled_tokens and a.status == RequestStatus.RUNNING
    assert out.waiting_for_grammar_ids == []


def test_only_constrained_rows_that_sample_need_a_mask():
    sched, runner = make_scheduler(budget=8), FakeRunner()
    sched.add_request(constrained("a", prompt_len=12, ready=True, length=99))
    sched.add_request(make_request("b", 2))
    out, _ = step(sched, runner)  # a's first chunk of 8: it does not sample yet
    assert out.num_scheduled_tokens["a"] == 8 and out.structured_output_request_ids == []
    out, _ = step(sched, runner)  # a's last 4 prompt tokens: it samples
    assert out.structured_output_request_ids == ["a"]
    out, _ = step(sched, runner)  # decodes of a and b: only a is constrained
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert out.structured_output_request_ids == ["a"]


def test_the_matcher_accepts_each_sampled_token_and_a_complete_grammar_stops():
    sched, runner = make_scheduler(), FakeRunner()
    a = constrained("a", ready=True, length=3, max_tokens=8)
    sched.add_request(a)
    updates = []
    while sched.has_unfinished_requests():
        updates += step(sched, runner)[1]
    assert a.structured_output.accepted == a.output_token_ids and len(a.output_token_ids) == 3
    assert updates[-1].finish_reason == FinishReason.STOP
    assert a.structured_output.closed  # its matcher is dropped with the request


def test_a_grammar_that_failed_to_compile_finishes_its_request_without_output():
    sched, runner = make_scheduler(), FakeRunner()
    a = constrained("a", ready=True, error="bad grammar")
    sched.add_request(a)
    out, updates = step(sched, runner)
    assert out.grammar_errors == {"a": "bad grammar"} and not out.is_empty
    assert [(u.request.request_id, u.new_token_ids, u.finish_reason) for u in updates] == \
        [("a", [], FinishReason.ABORT)]
    assert "bad grammar" in a.stop_reason
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.num_free_blocks == 64


def test_aborting_a_compiling_request_frees_everything():
    sched = make_scheduler()
    a = constrained("a")
    sched.add_request(a)
    sched.schedule()
    assert sched.abort_request("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.structured_output.closed
    assert not sched.has_unfinished_requests() and "a" not in sched.requests
    assert sched.kv_cache_manager.num_free_blocks == 64
    assert "a" in sched.schedule().finished_req_ids


def test_preemption_keeps_the_matcher_in_step_with_the_outputs():
    # 10 blocks of 4 tokens for two requests that need 6 each: one is preempted and recomputed
    sched, runner = make_scheduler(num_blocks=10, budget=64), FakeRunner()
    reqs = [constrained(r, prompt_len=8, max_tokens=16, ready=True, length=99) for r in "ab"]
    for r in reqs:
        sched.add_request(r)
    preempted = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        preempted += out.num_preemptions
    assert preempted > 0
    for r in reqs:
        assert r.structured_output.accepted == r.output_token_ids  # each token exactly once


# -- reasoning first: the constraint applies after reasoning_end_token_ids ----------------------
class ScriptRunner:
    """Samples each request's next token from its script (by output index)."""

    def __init__(self, sched, scripts: dict[str, list[int]]) -> None:
        self.sched, self.scripts = sched, scripts

    def execute(self, out) -> dict[str, list[int]]:
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            if out.num_computed_tokens[rid] + n == req.num_tokens:
                sampled[rid] = [self.scripts[rid][req.num_output_tokens]]
        return sampled


END = [900, 901]  # the end-of-think run: two tokens, to be split across steps
THINK = [5, 900, 6, 901, 900, 7, 900, 901, 40, 41, 42, 43]  # 900 901 ends at output index 8


def reasoning_request(rid, script=THINK, prompt_len=8, max_tokens=12, length=99, end=END,
                      start=None):
    req = make_request(rid, prompt_len, max_tokens, structured_outputs=SO(
        regex="x", reasoning_end_token_ids=end, reasoning_start_token_ids=start))
    req.structured_output = FakeConstraint(ready=True, length=length)
    return req


def test_reasoning_is_free_and_the_constraint_applies_after_its_end_run():
    sched = make_scheduler()
    a = reasoning_request("a")
    sched.add_request(a)
    runner = ScriptRunner(sched, {"a": THINK})
    masked = []  # whether each output token was sampled under a mask
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        masked.append("a" in out.structured_output_request_ids)
    assert a.output_token_ids == THINK
    assert masked == [False] * 8 + [True] * 4  # lone 900s and 901s do not end it; 900 901 does
    assert a.constraint_start == 8
    assert a.structured_output.accepted == THINK[8:]  # the matcher saw only the answer


def test_the_end_run_may_close_in_the_last_step_and_the_grammar_then_stops():
    sched = make_scheduler()
    a = reasoning_request("a", script=[900, 901, 50, 51, 52], length=2, max_tokens=5)
    sched.add_request(a)
    runner = ScriptRunner(sched, {"a": [900, 901, 50, 51, 52]})
    updates = []
    while sched.has_unfinished_requests():
        updates += step(sched, runner)[1]
    assert a.output_token_ids == [900, 901, 50, 51]
    assert a.structured_output.accepted == [50, 51] and updates[-1].finish_reason == FinishReason.STOP


def test_without_the_end_run_it_never_masks_and_plain_constraints_mask_from_the_start():
    sched = make_scheduler()
    a = reasoning_request("a", script=[1] * 6, max_tokens=6)
    b = constrained("b", ready=True, length=99, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    assert b.constraint_start == 0 and a.constraint_start is None
    runner = ScriptRunner(sched, {"a": [1] * 6, "b": [2] * 6})
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert "a" not in out.structured_output_request_ids
        assert ("b" in out.structured_output_request_ids) == ("b" in out.num_scheduled_tokens)
    assert a.structured_output.accepted == [] and a.finish_reason == FinishReason.LENGTH
    assert b.structured_output.accepted == [2] * 6


def test_preemption_while_thinking_keeps_the_activation_and_the_matcher_in_step():
    # 6 blocks of 4 tokens for two requests that need 6 each: one is preempted while it thinks
    sched = make_scheduler(num_blocks=6, budget=64)
    script = [3, 4, 5, 900, 901, 6, 7, 8, 9, 10, 11, 12]  # the end run closes at index 5
    reqs = [reasoning_request(r, script=script, prompt_len=10, max_tokens=12) for r in "ab"]
    for r in reqs:
        sched.add_request(r)
    runner = ScriptRunner(sched, {"a": script, "b": script})
    by_id = {r.request_id: r for r in reqs}
    preempted_at = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted_at += [by_id[rid].num_output_tokens for rid in out.preempted_req_ids]
        for rid in out.structured_output_request_ids:  # masked only once the answer began
            assert by_id[rid].num_output_tokens >= 5
        sched.update_from_output(out, runner.execute(out))
    assert preempted_at and min(preempted_at) < 5  # one was preempted mid-thought
    for r in reqs:
        assert r.output_token_ids == script and r.constraint_start == 5
        assert r.structured_output.accepted == script[5:]  # each answer token exactly once


def run_scripted(req, script):
    sched = make_scheduler()
    sched.add_request(req)
    runner = ScriptRunner(sched, {req.request_id: script})
    steps = []  # (masked, the token also allowed) as each output token was sampled
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        steps.append((req.request_id in out.structured_output_request_ids,
                      out.structured_output_also_allowed.get(req.request_id)))
    return steps


def test_with_a_start_run_an_output_that_opens_it_reasons_first():
    script = [800, 5, 6, 900, 901, 40, 41]  # <think> 5 6 </think> answer
    a = reasoning_request("a", start=[800], max_tokens=7)
    steps = run_scripted(a, script)
    # the first token: the grammar's mask plus <think>; then free until the end run
    assert steps == [(True, 800)] + [(False, None)] * 4 + [(True, None)] * 2
    assert a.structured_output.accepted == [40, 41] and a.constraint_start == 5


def test_with_a_start_run_an_output_that_does_not_open_it_is_constrained_from_its_start():
    script = [40, 41, 900, 901, 42]
    a = reasoning_request("a", start=[800], max_tokens=5)
    steps = run_scripted(a, script)
    assert steps == [(True, 800)] + [(True, None)] * 4  # masked throughout, never free
    assert a.structured_output.accepted == script and a.constraint_start == 0


def test_the_reasoning_start_token_is_allowed_on_top_of_the_filled_mask():
    backend = SlowBackend()
    backend.gate.set()
    backend.fill_bitmask = lambda matchers, bm: bm.fill(0)  # the grammar allows nothing
    manager = fake_manager(backend)
    try:
        states = [manager.request(SO(regex="a")) for _ in range(2)]
        deadline = time.time() + 10
        while not all(s.is_ready() for s in states) and time.time() < deadline:
            time.sleep(0.01)
        for background in (True, False):
            out = manager.grammar_bitmask(["r", "s"], states, background=background,
                                          also_allowed={"s": 63})
            allowed = allowed_of(out.bitmask, 64)
            assert [set(row.nonzero().flatten().tolist()) for row in allowed] == [set(), {63}]
    finally:
        manager.shutdown()


def test_reasoning_token_ids_are_validated_and_not_part_of_the_cache_key():
    assert SO(regex="a", reasoning_end_token_ids=[7], reasoning_start_token_ids=[6]).key() == \
        SO(regex="a").key()
    for bad in ([], [-1], ["x"], [True], list(range(17)), 5):
        with pytest.raises(ValueError, match="reasoning_end_token_ids"):
            SO(regex="a", reasoning_end_token_ids=bad)
        with pytest.raises(ValueError, match="reasoning_start_token_ids"):
            SO(regex="a", reasoning_end_token_ids=[7], reasoning_start_token_ids=bad)
    with pytest.raises(ValueError, match="needs reasoning_end_token_ids"):
        SO(regex="a", reasoning_start_token_ids=[6])


# -- the manager and the backends -----------------------------------------------------------------
def test_invalid_constraints_are_a_value_error_naming_the_problem():
    for params, words in [(SO(regex="[a-"), ["structured_outputs.regex", "unclosed"]),
                          (SO(grammar="start: foo"), ["structured_outputs.grammar", "foo"]),
                          (SO(json={"type": "array", "uniqueItems": True}),
                           ["structured_outputs.json", "uniqueItems"]),
                          (SO(json={"type": "nonsense"}), ["structured_outputs.json", "nonsense"])]:
        with pytest.raises(ValueError) as e:
            validate_structured_outputs(params)
        assert all(w in str(e.value) for w in words), str(e.value)
    validate_structured_outputs(SO(choice=["yes", "no"]))
    validate_structured_outputs(SO(grammar='root ::= "a" | "b"'))  # GBNF is read too


def test_the_xgrammar_backend_refuses_keywords_it_would_ignore():
    for schema, word in [({"type": "array", "uniqueItems": True}, "uniqueItems"),
                         ({"type": "object", "properties": {"a": {"not": {"type": "integer"}}}},
                          "not")]:
        with pytest.raises(ValueError, match=word):
            validate_structured_outputs(SO(json=schema), "xgrammar")
    # a property may be called "not"; an enum value may hold anything
    validate_structured_outputs(SO(json={"type": "object", "properties": {
        "not": {"type": "integer"}, "x": {"enum": [{"if": 1}]}}}), "xgrammar")
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        validate_structured_outputs(SO(regex="[a-"), "xgrammar")


class SlowBackend:
    """Compiles only when `gate` is set; counts compiles."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiled: list[tuple] = []

    def compile(self, params):
        self.gate.wait(10)
        self.compiled.append(params.key())
        return params.key()

    def matcher(self, compiled):
        return ("matcher", compiled)


def fake_manager(backend):
    m = StructuredOutputManager("auto", lambda: None, 64, [0])
    m._backend = backend
    return m


def test_compiles_run_off_the_caller_and_are_cached_by_the_constraint():
    backend = SlowBackend()
    manager = fake_manager(backend)
    try:
        first = manager.request(SO(regex="a+"))
        second = manager.request(SO(regex="a+"))
        other = manager.request(SO(regex="b+"))
        assert not first.is_ready()  # request() returned while the compile waits
        backend.gate.set()
        deadline = time.time() + 10
        while not all(s.is_ready() for s in (first, second, other)) and time.time() < deadline:
            time.sleep(0.01)
        assert first.matcher == second.matcher == ("matcher", ("regex", "a+"))
        assert backend.compiled == [("regex", "a+"), ("regex", "b+")] and manager.num_compiles == 2
    finally:
        backend.gate.set()
        manager.shutdown()


def test_closing_a_queued_compile_cancels_it():
    backend = SlowBackend()
    manager = fake_manager(backend)
    try:
        running = manager.request(SO(regex="a+"))  # holds the one compile thread
        queued = manager.request(SO(regex="b+"))
        queued.close()
        backend.gate.set()
        while not running.is_ready():
            time.sleep(0.01)
        time.sleep(0.05)
        assert backend.compiled == [("regex", "a+")] and queued.matcher is None
    finally:
        backend.gate.set()
        manager.shutdown()


def test_real_backend_masks_follow_the_grammar(tokenizer):
    manager = StructuredOutputManager("auto", lambda: tokenizer, len(tokenizer),
                                      [tokenizer.eos_token_id])
    try:
        s = manager.request(SO(choice=["yes", "no"]))
        while not s.is_ready():
            time.sleep(0.01)
        out = manager.grammar_bitmask(["r"], [s])
        allowed = np.flatnonzero(np.unpackbits(out.bitmask.view(np.uint8), bitorder="little"))
        texts = {tokenizer.decode([t]) for t in allowed}
        assert {"yes", "no"} <= texts and all("yes".startswith(t) or "no".startswith(t)
                                             for t in texts)
        assert s.accept(tokenizer.encode("yes", add_special_tokens=False)[0])
        assert s.is_terminated()
    finally:
        manager.shutdown()


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from kvflow.tokenizer import get_tokenizer

    return get_tokenizer(default_model_path)


# -- the sampler ------------------------------------------------------------------------------------
def random_bitmask(rows, vocab, seed=0):
    g = np.random.default_rng(seed)
    return g.integers(-2**31, 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)


def allowed_of(bitmask, vocab):
    return torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
                            [:, :vocab].astype(bool))


def test_the_bitmask_sets_exactly_the_disallowed_tokens_to_minus_inf():
    logits = torch.randn(5, 100)
    bm = random_bitmask(2, 100)
    masked = logits.clone()
    apply_grammar_bitmask(masked, [3, 1], bm)
    allowed = allowed_of(bm, 100)
    for row, i in ((3, 0), (1, 1)):
        expect = logits[row].masked_fill(~allowed[i], float("-inf"))
        assert torch.equal(masked[row], expect)
    for row in (0, 2, 4):
        assert torch.equal(masked[row], logits[row])


def test_every_sampling_mode_sees_the_masked_logits():
    V = 64
    allowed = [5, 9]
    bm = np.zeros((1, 2), dtype=np.int32)
    for t in allowed:
        bm[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    for params in [SamplingParams(temperature=0, logprobs=3),
                   SamplingParams(temperature=1.0, top_k=20, top_p=0.9, logprobs=2),
                   SamplingParams(temperature=0.7, presence_penalty=1.5, repetition_penalty=1.3),
                   SamplingParams(temperature=0, logit_bias={7: 100.0})]:
        for seed in range(5):
            logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed))
            apply_grammar_bitmask(logits, [0], bm)
            meta = build_sampling_metadata([SamplingRow(params, [1, 2], [3])], V)
            out = Sampler()(logits, meta)
            assert out.sampled_token_ids[0] in allowed
            if params.logprobs:
                lp = out.logprobs[0]
                assert all(math_ok(x) for x in lp.logprobs)  # JSON-safe: no -inf
                assert set(lp.token_ids[1:3]) <= set(allowed)


def math_ok(x: float) -> bool:
    return x == x and x > float("-inf")


def test_a_grammar_that_allows_only_eos_ends_before_min_tokens():
    V, eos = 32, 2
    bm = np.array([[1 << eos]], dtype=np.int32)
    logits = torch.randn(1, V)
    apply_grammar_bitmask(logits, [0], bm)
    meta = build_sampling_metadata([SamplingRow(SamplingParams(min_tokens=5, temperature=0),
                                                [1], [], eos_token_ids=(eos,))], V)
    meta.grammar_masked = True  # as the runner says when it applied a mask
    assert Sampler()(logits, meta).sampled_token_ids == [eos]


# -- end to end with the default model (slow) --------------------------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1,
                  "maxItems": 3}}, "required": ["name", "age", "languages"]}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "kind": {"anyOf": [{"const": "meeting"}, {"const": "call"}]},
    "attendees": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["title", "when", "kind"]}
REGEX = r"(\+1 )?[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'
GBNF = 'root ::= ("yes" | "no") ", because " [a-z ]{1,30} "."'


def checks():
    """(prompt, constraint, check of the text)"""
    return [
        ("Describe a programmer as JSON:", SO(json=PERSON),
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("A calendar event as JSON:", SO(json=EVENT),
         lambda t: jsonschema.validate(json.loads(t), EVENT)),
        ("Some JSON about cats:", SO(json_object=True),
         lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        ("Call me at", SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        ("Review: 'great film!' Sentiment:", SO(choice=CHOICES),
         lambda t: t in CHOICES or pytest.fail(t)),
        ("What is 6 times 7?", SO(grammar=LARK),
         lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t) or pytest.fail(t)),
        ("Is water wet?", SO(grammar=GBNF),
         lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", t) or pytest.fail(t)),
    ]


@pytest.fixture(scope="module")
def llm(default_model_path):
    from kvflow import LLM

    # float weights (the Q4_1 file dequantised): the reference that tensor parallelism, which
    # serves float weights only, must reproduce
    return LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=256,
               warmup=False, quantization="none")


def run_checks(llm, sampling: dict, n_rounds=1):
    cases = checks()
    params = [SamplingParams(max_tokens=120, structured_outputs=so, **sampling)
              for _, so, _ in cases]
    for _ in range(n_rounds):
        outs = llm.generate([p for p, _, _ in cases], params, use_tqdm=False)
        for (prompt, so, check), out in zip(cases, outs):
            c = out.outputs[0]
            if so.kind == "json_object" and sampling.get("temperature") and \
                    c.finish_reason == "length":
                continue  # any object may go on for ever when sampled; the others are bounded
            assert c.finish_reason == "stop", (so.kind, c.text)
            check(c.text)


@pytest.mark.slow
def test_every_constraint_kind_holds_greedy(llm):
    run_checks(llm, {"temperature": 0})


@pytest.mark.slow
def test_every_constraint_kind_holds_sampled(llm):
    run_checks(llm, {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 7,
                     "presence_penalty": 0.5, "logprobs": 2})
    run_checks(llm, {"temperature": 1.2, "min_tokens": 3})


@pytest.mark.slow
def test_unconstrained_neighbours_are_token_identical_to_running_alone(llm):
    plain = ["The capital of France is", "def fib(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, params, use_tqdm=False)]
    cases = checks()
    prompts = [p for p, _, _ in cases] + plain
    mixed = llm.generate(prompts, [SamplingParams(max_tokens=60, temperature=0,
                                                  structured_outputs=so) for _, so, _ in cases]
                         + [params] * len(plain), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[len(cases):]] == alone
    for (_, _, check), out in zip(cases, mixed):
        check(out.outputs[0].text)


@pytest.mark.slow
def test_a_constraint_applies_after_the_reasoning_ends(llm):
    """The default model does not think, so two tokens its greedy path writes at a known step
    play `</think>`: before and through them the output is the unconstrained one, after them
    it is one of the choices. With a start run (qwen3's rule): a first token that opens it
    reasons the same way, one that does not is constrained from the start."""
    prompt = "Review: 'great film!' Sentiment:"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(4, 10) if (free[i], free[i + 1]) not in zip(free[:i], free[1:i + 1]))
    end = [free[k], free[k + 1]]
    unlikely = llm.tokenizer.encode("<", add_special_tokens=False)  # not chosen here
    cases = [(SO(choice=CHOICES, reasoning_end_token_ids=end), k + 2),
             (SO(choice=CHOICES, reasoning_end_token_ids=end,
                 reasoning_start_token_ids=[free[0]]), k + 2),
             (SO(choice=CHOICES, reasoning_end_token_ids=end,
                 reasoning_start_token_ids=unlikely), 0)]  # not opened: no reasoning
    outs = llm.generate([prompt] * len(cases),
                        [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
                         for so, _ in cases], use_tqdm=False)
    for (so, answer_at), out in zip(cases, outs):
        c = out.outputs[0]
        ids = list(c.token_ids)
        assert ids[:answer_at] == list(free[:answer_at]), so  # the thinking was free
        assert c.finish_reason == "stop", (so, c.text)
        assert llm.tokenizer.decode(ids[answer_at:]) in CHOICES, (so, c.text)


@pytest.mark.slow
def test_invalid_constraints_are_refused_before_anything_runs(llm):
    from kvflow.engine.protocol import EngineCoreRequest

    for so in [SO(regex="(unclosed"), SO(grammar="start: nowhere"),
               SO(json={"type": "object", "properties": {"a": {"type": "array",
                                                                "uniqueItems": True}}})]:
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["ok", "bad"], [SamplingParams(), SamplingParams(structured_outputs=so)],
                         use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()  # the good prompt was not queued either
        with pytest.raises(ValueError, match="structured_outputs"):  # the core checks too
            llm.engine.core.add_request(EngineCoreRequest(
                "direct", [1, 2, 3], SamplingParams(structured_outputs=so)))
        assert not llm.engine.core.has_unfinished_requests()


@pytest.mark.slow
def test_constrained_requests_survive_preemption(default_model_path, monkeypatch):
    from kvflow import LLM
    from kvflow.core.scheduler import Scheduler

    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt",
                        lambda self, req, out: (preempted.append(req.request_id),
                                                original(self, req, out))[1])
    # Six requests of >= 17 tokens each need 12 blocks of 16 and the pool has 8, so the
    # shortest valid answer ({"name", "age", "languages"}, ~20 tokens) already preempts,
    # whichever weights (quantized or not) and CPU kind produce it.
    small = LLM(default_model_path, dtype="float32", max_model_len=128, num_blocks=8,
                block_size=16, warmup=False, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=80, temperature=0, structured_outputs=SO(json=PERSON))
        outs = small.generate([f"Person number {i} as JSON:" for i in range(6)], params,
                              use_tqdm=False)
        assert preempted
        for o in outs:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
            jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    finally:
        small.engine.shutdown()


@pytest.mark.slow
def test_the_xgrammar_backend_is_selectable(default_model_path):
    from kvflow import LLM

    llm = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=128,
              warmup=False, structured_outputs_backend="xgrammar")
    try:
        cases = [c for c in checks() if c[1].kind != "grammar" or "::=" in c[1].grammar]
        outs = llm.generate([p for p, _, _ in cases],
                            [SamplingParams(max_tokens=120, temperature=0, structured_outputs=so)
                             for _, so, _ in cases], use_tqdm=False)
        for (_, so, check), out in zip(cases, outs):
            assert out.outputs[0].finish_reason == "stop", (so.kind, out.outputs[0].text)
            check(out.outputs[0].text)
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="[a-")), use_tqdm=False)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_constraints_hold_under_tensor_parallelism(llm, default_model_path):
    """Only rank 0 samples, so only it masks; the outputs equal one process's."""
    from kvflow import LLM

    cases = checks()[:5]
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=so)
              for _, so, _ in cases] + [SamplingParams(max_tokens=16, temperature=0)]
    prompts = [p for p, _, _ in cases] + ["The capital of France is"]
    one = llm.generate(prompts, params, use_tqdm=False)
    tp = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=256,
             warmup=False, tensor_parallel_size=3, quantization="none")
    try:
        three = tp.generate(prompts, params, use_tqdm=False)
    finally:
        tp.engine.shutdown()
    assert [o.outputs[0].token_ids for o in three] == [o.outputs[0].token_ids for o in one]
    for (_, _, check), out in zip(cases, three):
        check(out.outputs[0].text)


@pytest.mark.slow
def test_the_served_engine_constrains_and_refuses_in_its_own_process(default_model_path):
    """AsyncLLM (the server's engine): the core process loads its tokenizer on the first
    constrained request; a bad constraint is a ValueError before it reaches the core."""
    import asyncio

    from kvflow.config import CacheConfig, EngineConfig, ModelConfig
    from kvflow.engine.async_engine import AsyncLLM

    async def main():
        engine = AsyncLLM(EngineConfig(ModelConfig(default_model_path, dtype="float32"),
                                       CacheConfig(num_blocks=64), warmup=False))
        await engine.start()
        try:
            ids = engine.tokenizer.encode("Review: 'awful'. Sentiment:")
            tokens, finish = [], None
            async for out in engine.generate(ids, SamplingParams(
                    temperature=0, max_tokens=20, structured_outputs=SO(choice=CHOICES)), "a"):
                tokens += out.outputs[0].token_ids
                finish = out.outputs[0].finish_reason
            assert engine.tokenizer.decode(tokens) in CHOICES and finish == "stop"
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                async for _ in engine.generate(ids, SamplingParams(
                        structured_outputs=SO(regex="[a-")), "b"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())
