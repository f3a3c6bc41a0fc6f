"""LoRA adapters under tensor and pipeline parallelism: greedy tokens (fp32) with TP=2, PP=2 and
TP=2 x PP=2, on kvflow's processes and on Ray, equal one process's with the same adapters, for
a batch mixing the base model and two PEFT adapters (rank 8 and rank 4, all seven projections)
under chunked prefill, one adapter named at start-up and one loaded at run time after steps
have run; a rank that cannot load an adapter fails the load, not the engine."""
from __future__ import annotations

import random

import pytest
import torch

from conftest_model_helpers import _save_random, save_byte_tokenizer
from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.model.lora_shard import ROW_PARALLEL, LoRAShard, shard_adapter
from kvflow.model.sharding import shard_layout
from lora_helpers import save_random_adapter
from tiny_arch_models import write_gguf

pytestmark = pytest.mark.slow  # starts ranks

# 8 heads over 2 KV heads (one each at TP=2), 4 layers (two stages of two)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1001, max_position_embeddings=1024)
# 32 tokens a step: every prompt is prefilled in chunks, beside other requests' decodes
ENGINE = dict(dtype="float32", max_model_len=512, num_threads=1, quantization="none",
              max_num_batched_tokens=32, num_blocks=64, block_size=16, enable_lora=True,
              max_loras=2, max_lora_rank=8)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NEAR_TIE = 0.01
PROMPTS = [[random.Random(n).randrange(3, 1000) for _ in range(n)] for n in (50, 37, 21)]


def _model(root, kv_heads: int) -> tuple[str, str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, "num_key_value_heads": kv_heads}, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    path = _save_random(LlamaForCausalLM, config, str(root / "base"), seed=0)
    base = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    a = save_random_adapter(base, str(root / "a"), seed=11, r=8, alpha=16, b_scale=0.2)
    b = save_random_adapter(base, str(root / "b"), seed=12, r=4, alpha=8, b_scale=0.2)
    return path, a, b


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_tokenizer) -> tuple[str, str, str]:
    path, a, b = _model(tmp_path_factory.mktemp("lora_tp"), kv_heads=2)
    default_tokenizer.save_pretrained(path)
    return path, a, b


def run(model: tuple[str, str, str], params: SamplingParams = PARAMS, **kwargs) -> list:
    """Adapter `a` named at start-up; a first batch of the base model and `a`; then `b`,
    loaded at run time by its request, in a batch of every prompt under the base, `a` and `b`."""
    path, a, b = model
    la, lb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    llm = LLM(path, **{**ENGINE, **kwargs}, lora_modules=[f"a={a}"])
    try:
        first = llm.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=[None, la])
        assert llm.engine.core.list_loras() == [1]
        order = [None, la, lb]
        mixed = llm.generate([p for p in PROMPTS for _ in order], params, use_tqdm=False,
                             lora_request=[lr for _ in PROMPTS for lr in order])
        assert llm.engine.core.list_loras() == [1, 2]
    finally:
        llm.engine.shutdown()
    if params.logprobs:
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in first + mixed]
    return [list(o.outputs[0].token_ids) for o in first + mixed]


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    out = run(tiny)
    mixed = out[2:]
    for j in range(len(PROMPTS)):  # each adapter changes what the base model says
        base, under_a, under_b = mixed[3 * j:3 * j + 3]
        assert under_a != base and under_b != base and under_a != under_b, j
    return out


def test_adapter_parts_sum_to_the_whole_adapter():
    """Column-parallel B cut by output rows, row-parallel A by input columns: the ranks' outputs
    (concatenated, or summed before the all-reduce) equal the whole adapter's, KV heads
    replicated where there are fewer than ranks."""
    from kvflow.model.arch import LlamaArchConfig
    from kvflow.model.lora import LoRAAdapter, module_shapes

    arch = LlamaArchConfig(**{**SHAPE, "num_key_value_heads": 1}, architecture="LlamaForCausalLM",
                           head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                           tie_word_embeddings=False, attention_bias=False, bos_token_id=1,
                           eos_token_id=2)
    g = torch.Generator().manual_seed(0)
    weights = {(i, m): (torch.randn(4, k, generator=g), torch.randn(n, 4, generator=g))
               for i in range(4) for m, (k, n) in module_shapes(arch).items()}
    adapter = LoRAAdapter("x", 1, "/x", 4, 1.0, weights)
    parts = [shard_adapter(adapter, LoRAShard(shard_layout(arch, r, 2), range(2, 4)), 16)
             for r in range(2)]
    assert all(set(p.weights) == {(i, m) for i in range(2) for m in module_shapes(arch)} for p in parts)
    for m, (k, _) in module_shapes(arch).items():
        x = torch.randn(3, k, generator=g)
        a, b = weights[(3, m)]
        whole = x @ a.T @ b.T
        if m in ROW_PARALLEL:
            cols = torch.tensor_split(torch.arange(k), 2)
            got = sum(x[:, c] @ p.weights[(1, m)][0].T @ p.weights[(1, m)][1].T
                      for c, p in zip(cols, parts))
            torch.testing.assert_close(got, whole)
        elif m in ("k_proj", "v_proj"):  # one KV head, on both ranks
            for p in parts:
                torch.testing.assert_close(x @ p.weights[(1, m)][0].T @ p.weights[(1, m)][1].T, whole)
        else:
            got = torch.cat([x @ p.weights[(1, m)][0].T @ p.weights[(1, m)][1].T for p in parts], 1)
            torch.testing.assert_close(got, whole)


def test_tp2_equals_one_process(tiny, reference):
    assert run(tiny, tensor_parallel_size=2) == reference


def test_pp2_equals_one_process(tiny, reference):
    assert run(tiny, pipeline_parallel_size=2) == reference


def test_tp2_by_pp2_equals_one_process(tiny, reference):
    assert run(tiny, tensor_parallel_size=2, pipeline_parallel_size=2) == reference


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory) -> tuple[str, str, str]:
    """The tiny model as a Q8_0 GGUF file (served as stored under PP), with its adapters."""
    root = tmp_path_factory.mktemp("lora_q8_0")
    path, a, b = _model(root, kv_heads=2)
    save_byte_tokenizer(path, SHAPE["vocab_size"])
    return write_gguf(path, str(root / "q8_0.gguf"), quant="Q8_0"), a, b


def test_adapters_over_quantized_weights_under_pp2_follow_one_process(tiny_q8_0):
    """Each stage's packed blocks are one process's, and PP alone over them is exact
    (test_quantized_parallel.py); with adapters over them a Sapphire Rapids Xeon moved some
    steps' logprobs by ~1e-3 (not found why; a Zen 4 gave one process's tokens exactly), so:
    greedy tokens equal wherever one process's top two are more than NEAR_TIE apart (a near-tie
    may flip; that output's comparison stops there), logprobs within NEAR_TIE."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    reference = run(tiny_q8_0, params, quantization="gguf")
    mixed = [tokens for tokens, _ in reference[2:]]
    assert all(mixed[3 * j] != mixed[3 * j + 1] != mixed[3 * j + 2] for j in range(len(PROMPTS)))
    got = run(tiny_q8_0, params, quantization="gguf", pipeline_parallel_size=2)
    compared = 0
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference):
        for t, step, ref_t, ref_step in zip(tokens, lps, ref_tokens, ref_lps):
            top = sorted(ref_step.values(), reverse=True)
            if t != ref_t:
                assert top[0] - top[1] < NEAR_TIE, (t, ref_t, ref_step)
                break
            assert abs(step[t] - ref_step[t]) < NEAR_TIE
            compared += 1
    assert compared >= 0.9 * sum(len(tokens) for tokens, _ in reference)


def test_tp2_with_replicated_kv_heads_equals_one_process(tmp_path_factory, default_tokenizer):
    """One KV head over two ranks: each holds it whole, with the adapters' whole k and v B."""
    model = _model(tmp_path_factory.mktemp("lora_kv1"), kv_heads=1)
    default_tokenizer.save_pretrained(model[0])
    assert run(model, tensor_parallel_size=2) == run(model)


def test_a_rank_that_cannot_load_an_adapter_fails_the_load_not_the_engine(tiny, reference):
    """The driver's checks pass (here: skipped), rank 1 cannot read the folder: the load is a
    ValueError naming the rank, the adapter is registered nowhere, and the engine serves on;
    an adapter unloaded and loaded again under a new id serves the same tokens on every rank."""
    path, a, b = tiny
    llm = LLM(path, **ENGINE, lora_modules=[f"a={a}"], tensor_parallel_size=2)
    try:
        core = llm.engine.core
        lora = core.executor.runner.lora
        real_add = lora.add
        lora.add = lambda request: True  # the driver "loads" it; the other rank cannot
        with pytest.raises(ValueError, match="rank 1 could not load it .*no such folder"):
            core.add_lora(LoRARequest("gone", 3, str(a) + "-missing"))
        lora.add = real_add
        assert core.list_loras() == [1]
        out = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False,
                           lora_request=[None, LoRARequest("a", 1, a)])
        assert [list(o.outputs[0].token_ids) for o in out] == reference[:2]
        assert core.remove_lora(1) and core.list_loras() == []
        out = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False,
                           lora_request=[None, LoRARequest("a", 4, a)])
        assert [list(o.outputs[0].token_ids) for o in out] == reference[:2]
        assert core.list_loras() == [4]
    finally:
        llm.engine.shutdown()


# -- on Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on the loopback interface, for this module only."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


def test_pp2_on_ray_equals_one_process(ray_cluster, tiny, reference):
    assert run(tiny, pipeline_parallel_size=2, distributed_executor_backend="ray") == reference


def test_tp2_on_ray_equals_one_process(ray_cluster, tiny, reference):
    assert run(tiny, tensor_parallel_size=2, distributed_executor_backend="ray") == reference
