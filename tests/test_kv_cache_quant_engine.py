"""The default model served from one-byte KV caches (`kv_cache_dtype` fp8 and int8): about twice
bf16's blocks in the same `kv_cache_memory`, the start-up line says so, and greedy next tokens
agree with the bf16 cache's over a few prompts (each position given the same history: the
bf16 engine's own greedy continuation, cut at every token)."""
from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads the default model

PROMPTS = ["The capital of France is", "Write a short poem about the sea.",
           "Explain in one paragraph how a transistor works.", "def fibonacci(n):"]
STEPS = 24


def _engine(kv_cache_dtype: str) -> LLM:
    return LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory="48MiB", max_model_len=512,
               warmup=False)


def _next_tokens(llm: LLM, histories: list[list[int]]) -> list[int]:
    outs = llm.generate(histories,
                        SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids[0] for o in outs]


@pytest.fixture(scope="module")
def bf16():
    llm = _engine("bfloat16")
    tok = llm.tokenizer
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    histories = []
    for p, o in zip(PROMPTS, outs):
        ids = tok.encode(p, add_special_tokens=True) + list(o.outputs[0].token_ids)
        n = len(ids) - STEPS
        histories += [ids[:n + i] for i in range(STEPS)]
    return llm, histories, _next_tokens(llm, histories)


@pytest.mark.parametrize("kv_cache_dtype,min_ratio", [("fp8", 1.95), ("int8", 1.83)])
def test_one_byte_cache_holds_twice_the_tokens_and_agrees_with_bf16(bf16, kv_cache_dtype, min_ratio):
    ref, histories, want = bf16
    llm = _engine(kv_cache_dtype)
    core = llm.engine.core
    assert core.cache_config.num_blocks >= min_ratio * ref.engine.core.cache_config.num_blocks
    assert core.kv_bytes_per_token * 2 <= ref.engine.core.kv_bytes_per_token * 1.07
    report = core.startup_report()
    assert f"{core.kv_bytes_per_token} B/token" in report and "c-decode-" in report
    got = _next_tokens(llm, histories)
    agree = sum(a == b for a, b in zip(got, want)) / len(want)
    assert agree >= 0.9, f"{kv_cache_dtype}: next-token agreement with bf16 {agree:.3f}"
    # a repeated prompt is served from its cached quantized blocks with the same tokens
    again = _next_tokens(llm, histories[-3:])
    assert again == got[-3:]


def test_hybrid_sliding_window_model_on_an_int8_cache(tmp_path):
    """Gemma 3's local/global layers (two KV cache groups, windows) on an int8 cache: the same
    greedy tokens as on a float32 cache, for a tiny random model."""
    from conftest_model_helpers import save_byte_tokenizer
    from window_model_helpers import save_tiny_gemma3

    path = str(tmp_path)
    save_tiny_gemma3(path)
    save_byte_tokenizer(path)
    prompts = [[5 + (i * 37 + n) % 290 for i in range(n)] for n in (9, 21, 40)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for cache in ("float32", "int8"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=cache, max_model_len=128, num_blocks=64,
                  block_size=4, max_num_batched_tokens=16, warmup=False)
        outs[cache] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for x, y in zip(outs["float32"], outs["int8"]) for a, b in zip(x, y))
    assert same >= 0.9 * 16 * len(prompts), outs
