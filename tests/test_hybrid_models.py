"""Hybrid models (LFM2's gated short convolutions, Qwen3.5's and Qwen3-Next's Gated DeltaNet:
layers that keep a state per request, beside attention layers) against Hugging Face
transformers in fp32: logits over chunked mixed batches with each sequence's state in its own
slot; greedy tokens through the engine with chunked prefill, a mixed batch, a preemption (the
state recomputed from the tokens) and a prefix-cache hit (a prompt sharing another's prefix
resumes from the state snapshot kept at a block boundary); only attention layers hold a KV
cache, and the state slots and snapshots (what the layers allocate) come out of the same
budget."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_matches_reference
from conftest_model_helpers import PagedDriver, hf_logits
from tiny_arch_models import hf_model
from tiny_hybrid_models import (BUILDERS, save_granite4h, save_lfm2, save_qwen3_5, save_qwen3_5_moe,
                                save_qwen3_next, write_granite4h_gguf, write_lfm2_gguf, write_qwen3_5_gguf)
from kvflow.core.kv_cache.spec import StateSpec
from kvflow.core.kv_cache.state import StateManager
from kvflow.model.loader import load_model

pytestmark = pytest.mark.slow  # loads models (make test-fast leaves it out)

torch.set_num_threads(1)
SEQ_LENS = {"a": 21, "b": 9, "c": 1, "d": 14}
# c and d finish their prompts first and decode while a and b arrive in chunks
PLAN = [{"c": 1, "d": 6, "b": 5}, {"c": 1, "d": 8, "a": 7, "b": 4},
        {"a": 9, "c": 1, "d": 1}, {"a": 5, "b": 1, "d": 1}, {"a": 1, "b": 1, "c": 1}]


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny(request, tmp_path_factory):
    path = BUILDERS[request.param](str(tmp_path_factory.mktemp(request.param) / "hf"))
    return request.param, path, hf_model(path)


def test_logits_match_hf_over_chunked_mixed_batches(tiny):
    name, path, hf = tiny
    model, arch = load_model(path, torch.float32)
    assert arch.architecture == type(hf).__name__
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert 0 < len(arch.attention_layers()) < arch.num_hidden_layers
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, arch.vocab_size, n + 3).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf, ids) for sid, ids in tokens.items()}
    driver = PagedDriver(model, arch, seed=7)
    done = dict.fromkeys(SEQ_LENS, 0)
    for step in PLAN:
        out = driver.step([(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()])
        for sid, n in step.items():
            torch.testing.assert_close(out[sid], refs[sid][done[sid]: done[sid] + n], atol=1e-4, rtol=1e-4)
            done[sid] += n
    assert done == {"a": 22, "b": 11, "c": 4, "d": 16}


def test_a_snapshot_taken_inside_a_chunk_resumes_to_hfs_logits(tiny):
    """a's 22 tokens run in one chunk, its state kept after token 11 (a block boundary at 12,
    taken mid-chunk, in a prompt chunk and not at its end); b shares those 12 tokens: it takes
    a's first three blocks and resumes from the snapshot, its other tokens give HF's logits."""
    name, path, hf = tiny
    model, arch = load_model(path, torch.float32)
    rng = np.random.default_rng(5)
    a = rng.integers(4, arch.vocab_size, 22).tolist()
    b = a[:12] + rng.integers(4, arch.vocab_size, 9).tolist()
    driver = PagedDriver(model, arch, seed=3)
    snap = driver.free_slots.pop(0)  # a slot no sequence gets
    out = driver.step([("a", a)], saves={"a": (11, snap)})
    torch.testing.assert_close(out["a"], hf_logits(hf, a), atol=1e-4, rtol=1e-4)
    driver.block_tables["b"] = driver.block_tables["a"][:3]
    driver.computed["b"] = 12
    driver.slots["b"] = driver.free_slots.pop()
    model.copy_states([(snap, driver.slots["b"])])
    out = driver.step([("b", b[12:16])])
    out.update({k + "2": v for k, v in driver.step([("b", b[16:])]).items()})
    ref = hf_logits(hf, b)
    torch.testing.assert_close(torch.cat([out["b"], out["b2"]]), ref[12:], atol=1e-4, rtol=1e-4)


_QWEN_FIELDS = ("linear_layers", "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "rotary_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers")
# llama.cpp's files: (the tiny folder, the converter's writer, the arch fields that must survive)
GGUF_CASES = {
    "lfm2": (lambda p: save_lfm2(p), write_lfm2_gguf, ("conv_layers", "conv_kernel_size")),
    # Qwen's llama.cpp files carry the layer pattern as an interval: the folders keep to one
    "qwen35": (lambda p: save_qwen3_5(p, full_attention_interval=2), write_qwen3_5_gguf, _QWEN_FIELDS),
    "qwen35moe": (lambda p: save_qwen3_5_moe(p, full_attention_interval=2), write_qwen3_5_gguf, _QWEN_FIELDS),
    # (llama.cpp's `qwen3next` has experts in every layer)
    "qwen3next": (lambda p: save_qwen3_next(p, full_attention_interval=2, mlp_only_layers=()), write_qwen3_5_gguf,
                  _QWEN_FIELDS),
    "granitehybrid": (lambda p: save_granite4h(p), write_granite4h_gguf,
                      ("mamba_layers", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                       "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias", "use_rope", "num_experts",
                       "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                       "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")),
}


@pytest.mark.parametrize("kind", list(GGUF_CASES))
def test_llama_cpp_gguf_loads_to_hfs_logits_and_serves(kind, tmp_path, monkeypatch):
    """llama.cpp's file of the tiny model (`lfm2`, `qwen35`, `qwen35moe`, `qwen3next`,
    `granitehybrid`): the
    same arch, HF's logits over a chunked mixed batch, and the engine's greedy tokens equal the
    HF folder's (its tokenizer from the file's metadata)."""
    from kvflow import LLM, SamplingParams
    from kvflow.model.arch import load_arch_config

    build, write, fields = GGUF_CASES[kind]
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = build(str(tmp_path / "hf"))
    gguf_path = write(path, str(tmp_path / f"{kind}.gguf"))
    want, got = load_arch_config(path), load_arch_config(gguf_path)
    same = ("architecture", "intermediate_size", "num_key_value_heads", "head_dim", "qk_norm",
            "tie_word_embeddings", "rope_theta", *fields)
    exact = [f for f in same if not isinstance(getattr(want, f), float)]
    assert {f: getattr(got, f) for f in exact} == {f: getattr(want, f) for f in exact}
    for f in ("rms_norm_eps", *(f for f in same if f not in exact)):  # float32s in the file
        assert getattr(got, f) == pytest.approx(getattr(want, f)), f
    hf = hf_model(path)
    model, arch = load_model(gguf_path, torch.float32)
    rng = np.random.default_rng(2)
    tokens = {sid: rng.integers(0, arch.vocab_size, n + 3).tolist() for sid, n in SEQ_LENS.items()}
    driver = PagedDriver(model, arch, seed=7)
    done = dict.fromkeys(SEQ_LENS, 0)
    for step in PLAN:
        out = driver.step([(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()])
        for sid, n in step.items():
            ref = hf_logits(hf, tokens[sid])[done[sid]: done[sid] + n]
            torch.testing.assert_close(out[sid], ref, atol=1e-4, rtol=1e-4)
            done[sid] += n
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [rng.integers(4, 320, n).tolist() for n in (7, 19)]
    outs = [LLM(p, dtype="float32", max_model_len=64).generate(prompts, params, use_tqdm=False)
            for p in (path, gguf_path)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


def _hf_greedy(hf, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[list[int]]]]:
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.logits]))
    return refs


def test_greedy_tokens_match_hf_through_chunks_a_preemption_and_a_shared_prefix(tiny, tmp_path):
    """Five prompts of different lengths at once, a 16-token budget, a pool too small for all of
    them (a preemption), two prompts sharing a 48-token prefix with the prefix cache on: the
    second resumes from the snapshot at the last block boundary the first one's steps crossed
    within the shared prefix (its 16-token chunks end at 16, 32, 48: all 48 tokens)."""
    from kvflow import LLM, SamplingParams

    name, path, hf = tiny
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, 320, 48).tolist()
    prompts = [prefix + rng.integers(4, 320, 5).tolist(),
               *[rng.integers(4, 320, n).tolist() for n in (30, 3, 17)], prefix + rng.integers(4, 320, 9).tolist()]
    refs = _hf_greedy(hf, prompts, 24)
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, dtype="float32", max_model_len=96, block_size=4, num_blocks=36,
              max_num_batched_tokens=16, enable_prefix_caching=True, trace=str(trace))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["preempted"] for s in steps), "the pool should have forced a preemption"
    assert any({r["phase"] for r in s["requests"]} == {"prefill", "decode"} for s in steps), \
        "prompt chunks and decodes should share steps"
    assert first.num_cached_tokens == 0 and rest[-1].num_cached_tokens == 48
    identical = 0
    for i, out in enumerate([first, *rest]):
        got = out.outputs[0].token_ids
        assert_matches_reference(got, refs[i], f"{name} prompt {i}")
        identical += got == refs[i][0]
    assert identical >= len(prompts) - 1
    core = llm.engine.core
    slots = [m for m in core.scheduler.kv_cache_manager.managers if type(m) is StateManager]
    assert len(slots) == 1 and slots[0].num_free_slots == slots[0].num_slots  # all given back
    assert slots[0].snapshots  # kept for later hits
    llm.engine.core.scheduler.kv_cache_manager.check_invariants()


def test_only_attention_layers_hold_kv_and_the_state_is_budgeted(tiny):
    from kvflow import LLM

    name, path, _ = tiny
    llm = LLM(path, dtype="float32", max_num_seqs=6, kv_cache_memory=1 << 20, block_size=4)
    core = llm.engine.core
    arch = core.arch
    attn = arch.attention_layers()
    per_layer = 2 * arch.num_key_value_heads * arch.head_dim * 4
    assert core.kv_bytes_per_token == len(attn) * per_layer
    state = arch.state_bytes_per_request(4)
    assert state == _allocated_state_bytes(core.executor.runner.model) // 12  # 6 slots + 6 snapshots
    specs = core.scheduler.kv_cache_manager.specs
    assert specs[-1] == StateSpec(state) and core.num_state_slots == 6
    # the 6 slots' bytes and as many snapshots' come out of the budget before the blocks are counted
    assert core.cache_config.num_blocks == ((1 << 20) - 12 * state) // (len(attn) * per_layer * 4)
    caches = core.executor.runner.kv_caches
    assert [i for i, c in enumerate(caches) if c is not None] == attn
    assert "6 slots + 6 prefix-cache snapshots" in core.startup_report()


def _allocated_state_bytes(model) -> int:
    """The bytes of every state tensor the model's layers allocated (all slots)."""
    return sum(t.numel() * t.element_size() for m in model.modules()
               for t in (getattr(m, "state", None), getattr(m, "conv_state", None),
                         getattr(m, "recurrent_state", None)) if isinstance(t, torch.Tensor))


def test_features_a_state_cannot_follow_yet_are_refused_by_name(tiny):
    from kvflow import LLM

    name, path, hf = tiny
    with pytest.raises(ValueError, match=f"speculative_config with {type(hf).__name__}.*rolled back"):
        LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor-parallel"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
