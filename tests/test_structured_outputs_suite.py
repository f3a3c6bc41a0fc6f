"""Structured outputs end to end on the default model: every constrained completion parses and
validates (JSON schema) or matches (regex, choice, grammar) and ends with "stop" because its
grammar terminated; the unconstrained requests batched beside them produce exactly the tokens
they produce alone (fp32, greedy). Schemas the backend cannot enforce are refused, never run
unconstrained."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import StructuredOutputsParams
from structured_schemas import SCHEMAS, UNSUPPORTED

pytestmark = pytest.mark.slow

MAX_TOKENS = 256  # a valid instance of every suite schema is far shorter: grammar ends first
FREE_TOKENS = 40

FREE_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain what a cache is in one sentence.",
    "List three colours.",
    "Tell me a short joke.",
    "How many legs does a spider have?",
]


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _constrained(**kind) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                          structured_outputs=StructuredOutputsParams(**kind))


def _free() -> SamplingParams:
    return SamplingParams(max_tokens=FREE_TOKENS, temperature=0)


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def llm(request):
    """The default model (fp32: exact greedy) with each grammar backend, on float weights: the
    prompts below were chosen for what those weights write (with the quantized default, int8
    activations, "Describe a cat as a JSON object." repeats keys until max_tokens)."""
    engine = LLM(dtype="float32", max_model_len=1024, structured_outputs_backend=request.param,
                 quantization="none")
    yield engine
    engine.engine.shutdown()


@pytest.fixture(scope="module")
def free_alone(llm) -> list[list[int]]:
    """The unconstrained requests' tokens with no constrained neighbour."""
    outs = llm.chat([_chat(p) for p in FREE_PROMPTS], _free(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run_mixed(llm, constrained: list[tuple[str, SamplingParams]]):
    """One batch: the constrained requests with the unconstrained ones interleaved among them.
    Returns (constrained outputs, unconstrained token ids), each in input order."""
    step = max(1, len(constrained) // len(FREE_PROMPTS))
    batch = []  # (prompt, params, "free" | "constrained")
    free = iter(FREE_PROMPTS)
    for i, (prompt, p) in enumerate(constrained):
        if i % step == 0 and (f := next(free, None)) is not None:
            batch.append((f, _free(), "free"))
        batch.append((prompt, p, "constrained"))
    batch += [(f, _free(), "free") for f in free]
    where = [w for _, _, w in batch]
    outs = llm.chat([_chat(p) for p, _, _ in batch], [p for _, p, _ in batch], use_tqdm=False)
    cons = [o.outputs[0] for o, w in zip(outs, where) if w == "constrained"]
    free_ids = [o.outputs[0].token_ids for o, w in zip(outs, where) if w == "free"]
    return cons, free_ids


def _check_neighbours(free_ids, free_alone) -> None:
    for prompt, mixed, alone in zip(FREE_PROMPTS, free_ids, free_alone):
        assert mixed == alone, f"unconstrained {prompt!r} changed beside constrained requests"


def test_suite_has_real_shapes():
    assert len(SCHEMAS) >= 40
    assert len({s["name"] for s in SCHEMAS}) == len(SCHEMAS)
    text = json.dumps([s["schema"] for s in SCHEMAS])
    for keyword in ("anyOf", "enum", "const", "pattern", "format", "minItems", "maxItems",
                    "minimum", "maximum", '"integer"', '"number"', '"boolean"', '"null"',
                    "additionalProperties"):
        assert keyword in text, keyword
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s["schema"])


def test_every_json_schema_completion_parses_and_validates(llm, free_alone):
    cons, free_ids = _run_mixed(llm, [(s["prompt"] + " Answer in JSON.", _constrained(json=s["schema"]))
                                      for s in SCHEMAS])
    failures = []
    for s, out in zip(SCHEMAS, cons):
        try:
            assert out.finish_reason == "stop", f"finish_reason {out.finish_reason}"
            jsonschema.validate(json.loads(out.text), s["schema"],
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{s['name']}: {str(e).splitlines()[0]} -- {out.text!r}")
    assert not failures, f"{len(failures)}/{len(SCHEMAS)} invalid:\n" + "\n".join(failures)
    _check_neighbours(free_ids, free_alone)


JSON_OBJECT_PROMPTS = ["Describe a cat as a JSON object.", "Give a person's name and age as a JSON object.",
                       "Return a JSON object with your favourite colour."]


def test_json_object_completions_are_objects(llm, free_alone):
    cons, free_ids = _run_mixed(llm, [(p, _constrained(json_object=True)) for p in JSON_OBJECT_PROMPTS])
    for prompt, out in zip(JSON_OBJECT_PROMPTS, cons):
        assert out.finish_reason == "stop", (prompt, out.text)
        assert isinstance(json.loads(out.text), dict), (prompt, out.text)
    _check_neighbours(free_ids, free_alone)


REGEXES = [
    ("Give a US phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("When did the first moon landing happen? Give the date.", r"\d{4}-\d{2}-\d{2}"),
    ("Give the IP address of a home router.", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"),
    ("Give an email address for a support desk.", r"[a-z]{2,12}@[a-z]{2,12}\.(com|org|net)"),
    ("Is the sky blue? Answer yes or no, then a reason.", r"(Yes|No), [a-z ]{1,40}\."),
]


def test_regex_constraints_match(llm, free_alone):
    cons, free_ids = _run_mixed(llm, [(p, _constrained(regex=r)) for p, r in REGEXES])
    for (prompt, pattern), out in zip(REGEXES, cons):
        assert out.finish_reason == "stop", (prompt, out.text)
        assert re.fullmatch(pattern, out.text), (prompt, pattern, out.text)
    _check_neighbours(free_ids, free_alone)


CHOICES = [
    ("Is this review positive or negative? 'The food was cold and the waiter rude.'",
     ["positive", "negative", "neutral"]),
    ("What is the capital of Germany?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Which is a programming language?", ["Python", "Banana", "Granite"]),
    ("Pick the largest planet.", ["Mercury", "Venus", "Earth", "Jupiter"]),
]


def test_choice_constraints_pick_one(llm, free_alone):
    cons, free_ids = _run_mixed(llm, [(p, _constrained(choice=c)) for p, c in CHOICES])
    for (prompt, choice), out in zip(CHOICES, cons):
        assert out.finish_reason == "stop", (prompt, out.text)
        assert out.text in choice, (prompt, out.text)
    _check_neighbours(free_ids, free_alone)


# (prompt, EBNF grammar, a regex accepting exactly the grammar's language)
GRAMMARS = [
    ("Is water wet?",
     'root ::= "The answer is " ("yes" | "no") "."',
     r"The answer is (yes|no)\."),
    ("Add two small numbers and write the sum.",
     'root ::= num " + " num " = " num\nnum ::= [0-9] | [1-9] [0-9]',
     r"(\d|[1-9]\d) \+ (\d|[1-9]\d) = (\d|[1-9]\d)"),
    ("List some primary colours as a JSON array.",
     'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= "\\"red\\"" | "\\"green\\"" | "\\"blue\\""',
     r'\["(red|green|blue)"(,"(red|green|blue)"){0,2}\]'),
    ("Write a SQL query that selects a column from a table.",
     'root ::= "SELECT " ident " FROM " ident ";"\nident ::= [a-z] [a-z_]? [a-z_]? [a-z_]? [a-z_]? [a-z_]?',
     r"SELECT [a-z][a-z_]{0,5} FROM [a-z][a-z_]{0,5};"),
]


def test_grammar_constraints_match(llm, free_alone):
    cons, free_ids = _run_mixed(llm, [(p, _constrained(grammar=g)) for p, g, _ in GRAMMARS])
    for (prompt, _, pattern), out in zip(GRAMMARS, cons):
        assert out.finish_reason == "stop", (prompt, out.text)
        assert re.fullmatch(pattern, out.text), (prompt, pattern, out.text)
    _check_neighbours(free_ids, free_alone)


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c["name"] for c in UNSUPPORTED])
def test_unsupported_schema_is_refused_never_unconstrained(llm, case):
    with pytest.raises(ValueError):
        llm.chat(_chat(case["prompt"]), _constrained(json=case["schema"]), use_tqdm=False)
    # the engine is still serving after the refusal
    out = llm.chat(_chat("Say hi."), _constrained(choice=["hi", "hello"]), use_tqdm=False)
    assert out[0].outputs[0].text in ("hi", "hello")


@pytest.mark.parametrize("kind", [{"grammar": 'root ::= ("a"'}, {"grammar": "root ::= undefined_rule"},
                                  {"grammar": 'start: "a" | b'}, {"regex": "(unclosed"}])
def test_invalid_grammar_or_regex_is_refused(llm, kind):
    with pytest.raises(ValueError):
        llm.chat(_chat("Anything."), _constrained(**kind), use_tqdm=False)
