"""The offline API on the default model: sampling controls, stopping, errors."""
from __future__ import annotations

import math

import pytest

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)


@pytest.fixture(scope="module")
def llm(default_model_path):
    # fp32 on every machine ("auto" is bf16 where the CPU has native bf16): in bf16 a request's
    # tokens can change with the batch around it (docs/configuration.md, "Dtype and kernels"), which the
    # batch-composition checks below would then see
    return LLM(default_model_path, dtype="float32", max_model_len=512, num_blocks=256)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    alone = [llm.generate([p], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
             for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    target = "Write a short poem about the sea:"
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = ["Tell me a joke.", "The weather today", "Numbers: 4 8 15"]
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(max_tokens=20, temperature=1.0)] * 2 + [params]
                         + [SamplingParams(max_tokens=5, temperature=0.7)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                       seed=99), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_and_temperature_zero_equal_greedy(llm):
    prompt = ["Once upon a time"]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    top1 = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=5),
                        use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_string_ends_the_text_before_it(llm):
    prompt = ["List the days of the week: Monday, Tuesday,"]
    full = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text.strip()[4:8]
    assert stop and stop in text
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and text.startswith(out.text)
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(stop) and text.startswith(kept.text)


def test_stop_token_ids_and_max_tokens(llm):
    prompt = ["Count: 1, 2, 3,"]
    full = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_id = full.token_ids[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_n_samples_and_logprobs(llm):
    out = llm.generate(["Pick a number:"], SamplingParams(n=3, max_tokens=8, temperature=1.0,
                                                         seed=42, logprobs=2), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and lp[tok].logprob <= 0 and len(lp) >= 2
            assert all(math.isfinite(v.logprob) for v in lp.values())
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_chat_uses_the_template(llm):
    outs = llm.chat([{"role": "user", "content": "Name a planet."}],
                    SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    text = outs[0].outputs[0].text
    assert text.strip() and "<|im_start|>" not in text
    assert "<|im_start|>assistant" in outs[0].prompt


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
])
def test_bad_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, kwargs, field", [
    ([1, 2, 10**6], {}, "prompt"),
    ([1, -1], {}, "prompt"),
    ("hi", {"stop_token_ids": [1_000_000], "min_tokens": 1, "max_tokens": 2}, "stop_token_ids"),
    ("hi", {"logit_bias": {10**6: 5}}, "logit_bias"),
    ("hi", {"top_k": 10**6}, "top_k"),
])
def test_ids_outside_the_vocabulary_raise_before_the_engine_steps(llm, prompt, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].token_ids


def test_logit_bias_forces_and_bans_tokens_offline(llm):
    banana = llm.tokenizer.encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    out = llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=3, temperature=0.8, seed=1, logit_bias={banana[0]: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == banana * 3
    plain = llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=1, temperature=0, logit_bias={plain: -100}), use_tqdm=False)[0].outputs[0].token_ids[0]
    assert banned != plain


def test_prompt_over_max_model_len_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"500 tokens.*max_tokens is 100.*max_model_len 512"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=100), use_tqdm=False)


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)


def test_unknown_model_path_is_refused():
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist")


def test_kv_cache_dtype_option_reaches_the_engine_config():
    """--kv-cache-dtype / LLM(kv_cache_dtype=...) share one option; aliases normalise, and a
    value the engine cannot store is refused by name rather than silently ignored."""
    import argparse

    from kvflow.options import add_engine_args, engine_config, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(**engine_kwargs(p.parse_args([]))).cache_config.cache_dtype == "auto"
    args = p.parse_args(["--kv-cache-dtype", "bfloat16"])
    assert engine_config(**engine_kwargs(args)).cache_config.cache_dtype == "bfloat16"
    assert engine_config(kv_cache_dtype="bf16").cache_config.cache_dtype == "bfloat16"
    assert engine_config(kv_cache_dtype="fp8").cache_config.cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="fp4")


def test_stats_are_each_steps_decisions_and_reading_them_changes_nothing(default_model_path):
    """A pool too small for three requests at once forces preemptions; every step's stats
    repeat what the scheduler recorded for that step, and reading them twice gives the same."""
    small = LLM(default_model_path, dtype="float32", max_model_len=64, block_size=4,
                num_blocks=12, max_num_batched_tokens=32, num_threads=1)
    core = small.engine.core
    plans, steps = [], []
    schedule, step = core.scheduler.schedule, core.step

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    def checking_step():
        result = step()
        out, stats = plans[-1], result.scheduler_stats
        assert core.stats(out, stats.step_time) == core.stats(out, stats.step_time) == stats
        steps.append((out, stats))
        return result

    core.scheduler.schedule, core.step = recording_schedule, checking_step
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = small.generate(["The capital of France is", "def fib(n):", "1, 2, 3, 4,"], params,
                          use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20, 20]
    for out, stats in steps:
        assert stats.num_preemptions == len(out.preempted_req_ids)
        assert stats.num_prompt_tokens == out.num_prefill_tokens
        assert stats.num_generation_tokens == out.num_decode_tokens
        assert stats.num_prompt_tokens + stats.num_generation_tokens == out.total_num_scheduled_tokens
    assert sum(stats.num_preemptions for _, stats in steps) > 0
    for o in outs:
        assert o.metrics["first_scheduled_time"] >= o.metrics["arrival_time"]
    small.engine.shutdown()


@pytest.mark.parametrize("prompt,kwargs,field", [
    ([5, 10**6], {}, "prompt"),
    ([5, 6], dict(stop_token_ids=[10**7]), "stop_token_ids"),
    ([5, 6], dict(logit_bias={10**7: 1.0}), "logit_bias"),
])
def test_engine_core_refuses_ids_outside_the_vocabulary_from_any_caller(llm, prompt, kwargs, field):
    """The frontends check first; the core holds the line for callers that bypass them."""
    from kvflow.engine.protocol import EngineCoreRequest

    core = llm.engine.core
    req = EngineCoreRequest("direct", prompt, SamplingParams(max_tokens=2, **kwargs))
    with pytest.raises(ValueError, match=field):
        core.add_request(req)
    assert not core.has_unfinished_requests()


def test_min_tokens_past_what_max_model_len_leaves_refuses_the_whole_batch(llm):
    """max_tokens=None resolves to what max_model_len leaves after the prompt; a min_tokens
    past that is refused before any prompt of the batch is queued."""
    max_len = llm.engine.max_model_len
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=None, min_tokens=max_len)]
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["Hi", "Hello there"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
