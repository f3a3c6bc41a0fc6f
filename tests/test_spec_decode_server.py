"""Speculative decoding with the default model (fp32): `LLM` and `kvflow serve` give the same
greedy tokens and text with n-gram speculation as without, over a mixed batch with chunked
prefill, preemption, stop strings and n > 1; streamed chunks may carry several tokens; logprobs
are the target's; /metrics reports acceptance."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
           "All that glitters is not gold. Actions speak louder than words.")
PROMPTS = [
    f"Copy this text exactly:\n{PASSAGE}\nCopy:\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# the same two "
    "functions again:\n",
    "Hi",
    "List the days of the week: Monday, Tuesday,",
    f"Repeat after me three times: {PASSAGE[:60]}",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def test_llm_greedy_with_ngram_equals_without(default_model_path, tmp_path):
    from kvflow import LLM, SamplingParams
    base = dict(dtype="float32", num_blocks=12, block_size=16, max_num_batched_tokens=48,
                max_model_len=384, warmup=False)
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=32, n=2),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=32, stop=["Sunday", "Friday"]),
              SamplingParams(temperature=0, max_tokens=40, logprobs=2)]
    results = []
    trace = str(tmp_path / "trace.jsonl")
    for spec in (None, SPEC):
        llm = LLM(**base, speculative_config=spec, trace=trace if spec else None)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results.append((outs, llm.engine.core.scheduler.spec_stats))
        llm.engine.shutdown()
    (plain, _), (spec_outs, stats) = results
    for a, b in zip(plain, spec_outs):
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.token_ids == ca.token_ids and cb.text == ca.text
            assert cb.finish_reason == ca.finish_reason and cb.stop_reason == ca.stop_reason
            if ca.logprobs is not None:
                assert len(cb.logprobs) == len(ca.logprobs)
                for la, lb in zip(ca.logprobs, cb.logprobs):
                    assert list(la) == list(lb)
                    for t in la:
                        assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
    assert plain[3].outputs[0].finish_reason == "stop"  # a stop string did end one
    assert stats.num_accepted_tokens > 20
    steps = [json.loads(line) for line in open(trace)]
    assert any(s["preempted"] for s in steps)  # the small pool preempted someone
    assert any(r["phase"] == "prefill" and r["num_computed_tokens"] > 0
               for s in steps for r in s["requests"])  # a prompt ran in chunks


@pytest.fixture(scope="module")
def servers():
    args = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks", "128",
            "--no-warmup"]
    plain = ServerProcess(*args)
    try:
        spec = ServerProcess(*args, "--speculative-config", json.dumps(SPEC))
    except BaseException:
        plain.close()
        raise
    yield plain, spec
    spec.close()
    plain.close()


def stream(url: str, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def test_serve_streams_the_same_text_with_speculation(servers):
    plain, spec = servers
    multi = False
    for prompt in PROMPTS[:2] + PROMPTS[3:4]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                "stop": ["Sunday"], "stream_options": {"include_usage": True}}
        want, want_chunks = stream(plain.url, body)
        got, got_chunks = stream(spec.url, body)
        assert got == want
        assert got_chunks[-1]["usage"] == want_chunks[-1]["usage"]
        finish = [c["choices"][0]["finish_reason"] for c in got_chunks
                  if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == [c["choices"][0]["finish_reason"] for c in want_chunks
                          if c["choices"] and c["choices"][0]["finish_reason"]]
        multi |= len(got_chunks) < len(want_chunks)  # some chunk carried several tokens
    assert multi
    metrics = httpx.get(f"{spec.url}/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("kvflow:spec_decode")}
    assert values["kvflow:spec_decode_num_accepted_tokens_total"] > 0
    assert values["kvflow:spec_decode_num_draft_tokens_total"] >= \
        values["kvflow:spec_decode_num_accepted_tokens_total"]
    assert 0 < values["kvflow:spec_decode_acceptance_rate"] <= 1
    assert values["kvflow:spec_decode_mean_acceptance_length"] > 1


def test_serve_refuses_a_bad_speculative_config_at_start():
    with pytest.raises(RuntimeError, match="speculative_config"):
        ServerProcess("--speculative-config", '{"method": "ngram", "k": 3}')
