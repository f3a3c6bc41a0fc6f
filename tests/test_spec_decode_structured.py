"""Speculative decoding with structured outputs: the grammar matcher cuts drafts it rejects,
each verified position gets the mask of the matcher after the drafts before it, and the matcher
is left as it was. Fast tests use the default model's tokenizer and both real backends; the
slow one checks that greedy constrained outputs with n-gram speculation equal those without."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from kvflow.request import RequestStatus
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams as SO
from kvflow.structured import StructuredOutputManager

from core_helpers import make_request, make_scheduler

LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from kvflow.tokenizer import get_tokenizer

    return get_tokenizer(default_model_path)


@pytest.fixture(params=["llguidance", "xgrammar"])
def manager(request, tokenizer):
    m = StructuredOutputManager(request.param, lambda: tokenizer, len(tokenizer),
                                [tokenizer.eos_token_id])
    yield m
    m.shutdown()


def ready(manager, params):
    s = manager.request(params)
    while not s.is_ready():
        time.sleep(0.005)
    assert s.error is None, s.error
    return s


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def mask(manager, state):
    return manager.grammar_bitmask(["r"], [state], background=False).bitmask[0].copy()


def test_validation_keeps_the_longest_accepted_prefix_and_leaves_the_matcher(manager, tokenizer):
    s = ready(manager, SO(grammar=LARK))
    good = encode(tokenizer, "The answer is 12")
    bad = encode(tokenizer, " xyz")
    before = mask(manager, s)
    assert s.validate_drafts(good) == len(good)
    assert s.validate_drafts(good + bad + good) == len(good)
    assert s.validate_drafts(bad) == 0
    assert np.array_equal(mask(manager, s), before)  # no state changed
    for t in good:  # and it still accepts the real tokens
        assert s.accept(t)


def test_each_verified_row_has_the_mask_after_the_drafts_before_it(manager, tokenizer):
    s, plain = ready(manager, SO(grammar=LARK)), ready(manager, SO(json_object=True))
    drafts = encode(tokenizer, "The answer is 42")
    before = mask(manager, s)
    out = manager.grammar_bitmask(["a", "b"], [s, plain], drafts={"a": drafts})
    assert out.num_rows == [len(drafts) + 1, 1]
    rows = out.bitmask
    assert rows.shape[0] == len(drafts) + 2
    assert np.array_equal(mask(manager, s), before)  # rolled back after the fill
    assert np.array_equal(rows[-1], mask(manager, plain))
    for i, t in enumerate(drafts):  # row i: what the grammar allows after drafts[:i]
        assert np.array_equal(rows[i], mask(manager, s))
        assert s.accept(t)
    assert np.array_equal(rows[len(drafts)], mask(manager, s))
    assert not np.array_equal(rows[0], rows[len(drafts)])


def test_the_scheduler_cuts_drafts_the_grammar_rejects(manager, tokenizer):
    sched = make_scheduler()
    req = make_request("r", 8, max_tokens=32)
    req.eos_token_ids = [tokenizer.eos_token_id]
    req.structured_output = ready(manager, SO(grammar=LARK))
    sched.add_request(req)
    out = sched.schedule()
    first = encode(tokenizer, "The answer is 7")
    sched.update_from_output(out, {"r": first[:1]})
    good = first[1:]
    bad = encode(tokenizer, " xyz")
    sched.update_draft_token_ids({"r": good + bad})
    assert req.spec_token_ids == good
    sched.update_draft_token_ids({"r": good[:1] + [tokenizer.eos_token_id] + good[1:]})
    assert req.spec_token_ids == good[:1]  # cut before an end of sequence
    sched.update_draft_token_ids({"r": good})
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens["r"] == good
    assert out.structured_output_request_ids == ["r"]
    # the runner accepted one draft: the matcher advances by it and the target's token only
    sched.update_from_output(out, {"r": [good[0], good[1]]})
    assert req.status == RequestStatus.RUNNING and req.output_token_ids == first[:3]
    assert req.structured_output.validate_drafts(first[3:]) == len(first) - 3


def test_a_request_that_may_still_reason_does_not_speculate(manager, tokenizer):
    sched = make_scheduler()
    req = make_request("r", 8, max_tokens=32, structured_outputs=SO(
        grammar=LARK, reasoning_end_token_ids=[5, 6]))
    req.structured_output = ready(manager, req.sampling_params.structured_outputs)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"r": [9]})
    assert not req.constraint_active
    sched.update_draft_token_ids({"r": [5, 6] + encode(tokenizer, "The answer")})
    assert req.spec_token_ids == []  # its reasoning is free text: no speculation there


# -- end to end with the default model (slow) ------------------------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1,
                  "maxItems": 3}}, "required": ["name", "age", "languages"]}
REGEX = r"(\+1 )?[0-9]{3}-[0-9]{4}"


@pytest.mark.slow
def test_greedy_constrained_outputs_with_ngram_speculation_equal_those_without(default_model_path):
    import json

    import jsonschema

    from kvflow import LLM

    cases = [("Describe a programmer as JSON. " * 3, SO(json=PERSON),
              lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ("Review: 'great film!' Sentiment: positive. Review: 'great!' Sentiment:",
              SO(choice=["positive", "negative"]),
              lambda t: t in ("positive", "negative") or pytest.fail(t)),
             ("Call me at 555-1234 or at", SO(regex=REGEX),
              lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
             ("The answer is 42. The answer is 42. What is 6 times 7?", SO(grammar=LARK),
              lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t) or pytest.fail(t))]
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=so)
              for _, so, _ in cases]
    prompts = [p for p, _, _ in cases]
    texts, tokens = {}, {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=128,
                  warmup=False, quantization="none", speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        texts[spec is None] = [o.outputs[0].text for o in outs]
        tokens[spec is None] = [list(o.outputs[0].token_ids) for o in outs]
        if spec is not None:  # sampled too: rejection sampling sees each position's mask
            sampled = llm.generate(prompts, [SamplingParams(
                max_tokens=80, temperature=0.8, seed=i, structured_outputs=so)
                for i, (_, so, _) in enumerate(cases)], use_tqdm=False)
            stats = llm.engine.core.scheduler.spec_stats
        llm.engine.shutdown()
    assert tokens[False] == tokens[True]
    for (_, _, check), text in zip(cases, texts[False]):
        check(text)
    for (_, _, check), out in zip(cases, sampled):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check(out.outputs[0].text)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
