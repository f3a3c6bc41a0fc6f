"""Sliding-window models under tensor and pipeline parallelism: greedy outputs equal one
process's for a Qwen2 whose third layer attends fully and whose others attend through a window
(so the KV cache has several groups, which a pipeline stage keeps as the whole model's: its
layers share the one KV tensor that the whole model's budget was sized for)
and a Mistral whose every layer has the window, with chunked prefill and preemption; on
kvflow's processes and on Ray."""
from __future__ import annotations

import random

import pytest

from conftest_model_helpers import _save_random
from window_model_helpers import generate_counting_preemptions

from kvflow.core.kv_cache.groups import make_kv_cache_groups
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

WINDOW = 8  # shorter than every prompt
SLIDING = "sliding_attention"
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1001, max_position_embeddings=1024)
ENGINE = dict(dtype="float32", max_model_len=512, num_threads=1, quantization="none")
# 32 tokens a step: chunked prompts; 24 blocks of 16 cannot hold four requests growing to 108
# tokens in the full-attention layer's group beside the window groups: some are preempted
SQUEEZED = dict(max_num_batched_tokens=32, num_blocks=24, block_size=16, max_num_seqs=8)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPTS = [[random.Random(n).randrange(3, 1000) for _ in range(n)] for n in (60, 45, 30, 11)]


@pytest.fixture(scope="module")
def qwen2_window(tmp_path_factory, default_tokenizer) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=[SLIDING, SLIDING, "full_attention", SLIDING],
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    path = _save_random(Qwen2ForCausalLM, config, str(tmp_path_factory.mktemp("q2w") / "m"), 0)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory, default_tokenizer) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    path = _save_random(MistralForCausalLM, config, str(tmp_path_factory.mktemp("mw") / "m"), 0)
    default_tokenizer.save_pretrained(path)
    return path


def run(model: str, **kwargs) -> tuple[list[list[int]], int]:
    """Each prompt's tokens from a fresh engine, and how many preemptions it made; checks that
    the driver's rank holds one KV tensor pair (a page of each of the groups' one layer)."""
    def check(core) -> None:
        # Qwen2's full layer and its three window layers: four groups of one layer each
        groups = make_kv_cache_groups(core.cache_config.layer_windows)
        assert len(groups) == (1 if "mw" in model else 4)
        if "mw" not in model:  # stage 0's two window layers: two groups, one shared tensor
            assert len({id(kv) for kv in core.executor.runner.kv_caches}) == 1

    return generate_counting_preemptions(model, PROMPTS, PARAMS, check, **ENGINE, **SQUEEZED,
                                         **kwargs)


@pytest.fixture(scope="module")
def references(qwen2_window, mistral_window) -> dict[str, list[list[int]]]:
    refs = {}
    for name, path in (("qwen2", qwen2_window), ("mistral", mistral_window)):
        out, preempted = run(path)
        # Mistral's window frees its blocks as it slides: only Qwen2's full layer runs out
        assert preempted or name == "mistral", f"{name}: the squeezed workload preempts nobody"
        assert len({tuple(o) for o in out}) == len(out)
        refs[name] = out
    return refs


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(tensor_parallel_size=2, pipeline_parallel_size=2)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_qwen2_with_window_layers_equals_one_process(qwen2_window, references, parallel):
    out, preempted = run(qwen2_window, **parallel)
    assert out == references["qwen2"]
    assert preempted


def test_mistral_window_under_pp2_equals_one_process(mistral_window, references):
    out, _ = run(mistral_window, pipeline_parallel_size=2)
    assert out == references["mistral"]


def test_qwen2_with_window_layers_on_ray_pp2_equals_one_process(qwen2_window, references):
    ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             logging_level="WARNING")
    try:
        out, _ = run(qwen2_window, pipeline_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert out == references["qwen2"]
