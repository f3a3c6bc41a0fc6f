"""Qwen3, Phi-3, Qwen3-MoE, Mixtral, Qwen2-MoE, OLMo 2, Granite, SmolLM3 and gpt-oss: tiny random
models built from transformers configs give Hugging Face's fp32 logits (1e-4) over a flat batch
of different-length prompts run in chunks beside decodes, HF's greedy tokens over 32 steps
through the engine with chunked prefill, and the same logits again when converted to GGUF the
way llama.cpp converts them (where tiny_arch_models.NO_GGUF does not say why not)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import NEW_TOKENS, assert_matches_reference
from conftest_model_helpers import PagedDriver, hf_logits
from tiny_arch_models import (BUILDERS, END_OF_TURN, NO_GGUF, ORIGINAL_CONTEXT, family,
                              hf_model, write_gguf)
from kvflow.model.arch import load_arch_config
from kvflow.models.registry import SUPPORTED_ARCHITECTURES
from kvflow.model.loader import load_model

pytestmark = pytest.mark.slow  # loads models (make test-fast leaves it out)

torch.set_num_threads(1)
ATOL = 1e-4
SEQ_LENS = {"a": 21, "b": 9, "c": 1, "d": 14}
DECODE_STEPS = 3
# c and d finish their prompts first and decode while a and b arrive in chunks
PLAN = [{"c": 1, "d": 6, "b": 5}, {"c": 1, "d": 8, "a": 7, "b": 4},
        {"a": 9, "c": 1, "d": 1}, {"a": 5, "b": 1, "d": 1}, {"a": 1, "b": 1, "c": 1}]


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny(request, tmp_path_factory):
    """(name, HF folder, HF model, token ids per sequence, HF logits per sequence)."""
    path = BUILDERS[request.param](str(tmp_path_factory.mktemp(request.param) / "hf"))
    hf = hf_model(path)
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, 320, n + DECODE_STEPS).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf, ids) for sid, ids in tokens.items()}
    return request.param, path, hf, tokens, refs


def _run_plan(model, arch, tokens, refs) -> None:
    driver = PagedDriver(model, arch, seed=7)
    done = dict.fromkeys(SEQ_LENS, 0)
    for step in PLAN:
        out = driver.step([(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()])
        for sid, n in step.items():
            got, want = out[sid], refs[sid][done[sid]: done[sid] + n]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
            done[sid] += n
    assert done == {"a": 22, "b": 11, "c": 4, "d": 16}  # every prompt whole, then decodes


def test_hf_folder_logits_match_hf_over_chunked_mixed_batches(tiny):
    name, path, hf, tokens, refs = tiny
    model, arch = load_model(path, torch.float32)
    assert arch.architecture == type(hf).__name__
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    if arch.num_experts:  # the routed layers really run the expert block
        assert any(layer.moe is not None for layer in model.layers)
        assert all((layer.moe is None) == (i in arch.mlp_only_layers) for i, layer in enumerate(model.layers))
    _run_plan(model, arch, tokens, refs)


def test_gguf_conversion_loads_to_the_same_model(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    name, path, hf, tokens, refs = tiny
    if name in NO_GGUF:
        pytest.skip(NO_GGUF[name])
    gguf_path = write_gguf(path, str(tmp_path / f"{name}.gguf"))
    model, arch = load_model(gguf_path, torch.float32)
    hf_arch = load_arch_config(path)
    same = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "shared_expert_intermediate_size", "qk_norm", "rotary_dim",
            "head_dim", "attention_bias", "tie_word_embeddings", "rope_theta")
    assert {f: getattr(arch, f) for f in same} == {f: getattr(hf_arch, f) for f in same}
    if hf_arch.rope_scaling:  # LongRoPE from the factor tensors and the attn_factor key
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            assert np.allclose(arch.rope_scaling[key], hf_arch.rope_scaling[key])
        assert abs(arch.rope_scaling["attention_factor"] - hf_arch.rope_scaling["attention_factor"]) < 1e-6
    _run_plan(model, arch, tokens, refs)


def test_gguf_keeps_the_chat_template_and_the_end_of_turn_stop(tiny, tmp_path, monkeypatch):
    """tokenizer.chat_template renders as the HF folder's template does, and the end-of-turn
    token (<|im_end|>, Phi-3's <|end|>) stops generation from the GGUF file as it does from
    generation_config.json, though the file's eos_token_id is only </s>."""
    from kvflow.tokenizer import get_tokenizer, render_chat

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    name, path, _, _, _ = tiny
    if name in NO_GGUF:
        pytest.skip(NO_GGUF[name])
    gguf_path = write_gguf(path, str(tmp_path / f"{name}.gguf"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, ids = render_chat(get_tokenizer(gguf_path), messages)
    assert (text, ids) == render_chat(get_tokenizer(path), messages)
    end = END_OF_TURN[family(path)]
    want_stops = [2] if end is None else [2, get_tokenizer(path).convert_tokens_to_ids(end)]
    assert end is None or end in text
    assert load_arch_config(path).eos_token_ids == want_stops  # config.json + generation_config.json
    assert load_arch_config(gguf_path).eos_token_ids == want_stops


def test_mixtral_gguf_with_one_tensor_per_expert_loads_the_same(tmp_path, monkeypatch):
    """Mixtral GGUFs converted before llama.cpp stacked the experts (blk.N.ffn_gate.E.weight)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = BUILDERS["mixtral"](str(tmp_path / "hf"))
    stacked, _ = load_model(write_gguf(path, str(tmp_path / "stacked.gguf")), torch.float32)
    legacy, arch = load_model(write_gguf(path, str(tmp_path / "legacy.gguf"), legacy_experts=True), torch.float32)
    assert arch.architecture == "MixtralForCausalLM" and arch.num_experts == 4
    for name, w in stacked.state_dict().items():
        assert torch.equal(legacy.state_dict()[name], w), name


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_q8_0_gguf_experts_dequantise_like_the_gguf_package(name, tmp_path, monkeypatch):
    """A Q8_0 file: each expert's weights are exactly the gguf package's dequantisation of
    its slice of the 3-D tensor (and Mixtral's q rows are un-permuted)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = BUILDERS[name](str(tmp_path / "hf"))
    gguf_path = write_gguf(path, str(tmp_path / "q8.gguf"), quant="Q8_0")
    model, arch = load_model(gguf_path, torch.float32)
    raw = {t.name: t for t in GGUFReader(gguf_path).tensors}
    assert raw["blk.0.ffn_up_exps.weight"].tensor_type.name == "Q8_0"
    inter, moe = arch.moe_intermediate_size, model.layers[0].moe
    for kind, ours in (("gate", moe.gate_up[:, :inter]), ("up", moe.gate_up[:, inter:]), ("down", moe.down)):
        t = raw[f"blk.0.ffn_{kind}_exps.weight"]
        want = dequantize(t.data, t.tensor_type).reshape(ours.shape)
        assert torch.equal(ours, torch.from_numpy(want.copy()))
    hf_q = hf_model(path).model.layers[0].self_attn.q_proj.weight
    q = model.layers[0].qkv_proj[:arch.num_attention_heads * arch.head_dim]
    torch.testing.assert_close(q, hf_q, atol=0.01, rtol=0.05)  # Q8_0 rounding, rows in HF order


def test_greedy_tokens_match_hf_through_the_engine_with_chunked_prefill(tiny, tmp_path):
    """The engine runs the prompts together, split into chunks by a 16-token budget: the
    greedy tokens equal HF's generate() over 32 steps, and the top-5 logprobs the engine
    returns at each step equal HF's log-softmax to 1e-4."""
    from kvflow import LLM, SamplingParams

    name, path, hf, _, _ = tiny
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((37, 5, 19, 2))]
    refs, hf_logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.logits]))
            hf_logprobs.append([s[0].float().log_softmax(-1) for s in out.logits])
    trace = tmp_path / "trace.jsonl"
    llm = LLM(path, dtype="float32", max_model_len=128, num_blocks=64, max_num_batched_tokens=16,
              trace=str(trace))
    assert len(llm.engine.core.arch.eos_token_ids) == (1 if name == "mixtral" else 2)  # + generation_config's
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                logprobs=5), use_tqdm=False)
    identical = 0
    for i, out in enumerate(outs):
        got = out.outputs[0].token_ids
        assert_matches_reference(got, refs[i], f"{name} prompt {i}")
        identical += got == refs[i][0]
        for j, step in enumerate(out.outputs[0].logprobs):
            if got[:j] != refs[i][0][:j]:
                break  # past a divergence the contexts differ
            assert len(step) >= 5
            for token, lp in step.items():
                assert abs(lp.logprob - hf_logprobs[i][j][token].item()) <= ATOL, (name, i, j, token)
    assert identical >= len(prompts) - 1
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(s["num_scheduled_tokens"] <= 16 for s in steps)
    chunks = [r for s in steps for r in s["requests"] if r["phase"] == "prefill"]
    assert len(chunks) > len(prompts), "the long prompts should have been split"


def test_bf16_greedy_tokens_stay_within_hf_bf16_top3(tiny):
    """dtype="bfloat16" (what "auto" picks on CPUs with native bf16: the experts then run on
    the bf16 panel GEMM with SiLU fused) follows HF's bf16 model."""
    from transformers import AutoModelForCausalLM

    from kvflow import LLM, SamplingParams

    name, path, _, _, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((29, 3, 12))]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.scores]))
    llm = LLM(path, dtype="bfloat16", max_model_len=128, num_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    # bf16 rounds a random tiny model's flat logits into near-ties, so a divergence may come
    # early: the first token must agree, a divergence must pick one of HF's top-3, and most
    # prompts must keep HF's exact tokens.
    identical = 0
    for i, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, refs[i], f"{name} bf16 prompt {i}", min_agree=1)
        identical += out.outputs[0].token_ids == refs[i][0]
    assert identical >= 2, f"{name}: only {identical} of 3 prompts kept HF bf16's tokens"


def test_longrope_tables_match_transformers_short_and_long_factors(tmp_path):
    """Phi-3's cos/sin: below the original context, transformers' short-factor frequencies;
    from it on, its long-factor ones (what it uses for a sequence longer than that), both
    scaled by the attention factor; only the first rotary_dim dims of a head rotate."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvflow.layers.rotary import rope_tables

    path = BUILDERS["phi3"](str(tmp_path / "phi3"))
    arch, cfg = load_arch_config(path), AutoConfig.from_pretrained(path)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=ORIGINAL_CONTEXT + 1)
    cos, sin = rope_tables(arch, 2 * ORIGINAL_CONTEXT)
    assert cos.shape == (2 * ORIGINAL_CONTEXT, arch.head_dim // 2) and factor > 1.1
    pos = torch.arange(2 * ORIGINAL_CONTEXT, dtype=torch.float32)
    for rows, inv_freq in ((slice(0, ORIGINAL_CONTEXT), short), (slice(ORIGINAL_CONTEXT, None), long)):
        freqs = torch.outer(pos[rows], inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        torch.testing.assert_close(cos[rows], emb.cos() * factor)
        torch.testing.assert_close(sin[rows], emb.sin() * factor)
    assert not torch.allclose(short, long)


_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("rope,head_dim", [
    (_YARN, 64),  # gpt-oss's own
    ({**_YARN, "factor": 4.0, "truncate": True, "original_max_position_embeddings": 64}, 16),
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}, 16),
    ({**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}, 32),  # DeepSeek's ratio of two mscales
    ({**_YARN, "attention_factor": 1.5, "beta_fast": 16.0, "beta_slow": 2.0}, 32),
    ({**_YARN, "partial_rotary_factor": 0.5}, 64),
])
def test_yarn_matches_transformers_compute_yarn_parameters(rope, head_dim, tmp_path):
    """YaRN's inverse frequencies and attention factor are transformers' _compute_yarn_parameters'
    for a config.json that transformers wrote, and the cos/sin tables are its rotary module's
    (the attention factor multiplies both), positions on both sides of the original context."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from kvflow.layers.rotary import rope_inv_freq, rope_tables, yarn_attention_factor

    cfg = GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=head_dim, vocab_size=320, max_position_embeddings=131072,
                       num_local_experts=4, num_experts_per_tok=2, rope_parameters=dict(rope))
    cfg.save_pretrained(tmp_path)
    arch = load_arch_config(str(tmp_path))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    assert arch.rope_dim == inv_freq.numel() * 2
    torch.testing.assert_close(rope_inv_freq(arch), inv_freq, rtol=0, atol=0)
    assert yarn_attention_factor(arch) == pytest.approx(factor, rel=1e-12) and factor != 1.0
    if "partial_rotary_factor" in rope:
        return  # transformers' gpt-oss module rotates whole heads
    n = 2 * rope["original_max_position_embeddings"]
    cos, sin = rope_tables(arch, n)
    want_cos, want_sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, n, 64), torch.arange(n)[None])
    torch.testing.assert_close(cos[:, :head_dim // 2], want_cos[0])
    torch.testing.assert_close(sin[:, :head_dim // 2], want_sin[0])
    torch.testing.assert_close(cos[:, head_dim // 2:], want_cos[0])


def test_unknown_architecture_fails_at_load_listing_the_supported(tmp_path):
    path = BUILDERS["qwen3"](str(tmp_path / "hf"))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNewForCausalLM"]
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as err:
        load_model(path, torch.float32)
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)
    assert "Qwen3MoeForCausalLM" in SUPPORTED_ARCHITECTURES and "Phi3ForCausalLM" in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("name,fmt", [("qwen2_moe", "hf"), ("phi3", "hf"), ("mixtral", "gguf")])
def test_tensor_parallel_2_gives_the_single_process_tokens(name, fmt, tmp_path, monkeypatch):
    """Experts split along their intermediate dimension (the router and the shared expert's
    gate whole on every rank), Phi-3's fused q/k/v and gate/up read at their offsets: TP=2
    greedy tokens equal one process's (HF folder, and the GGUF conversion cache for Mixtral)."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = BUILDERS[name](str(tmp_path / "hf"))
    if fmt == "gguf":
        path = write_gguf(path, str(tmp_path / f"{name}.gguf"))
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((23, 6, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", max_model_len=128, num_blocks=64, max_num_batched_tokens=16,
                  tensor_parallel_size=tp, num_threads=1)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert outs[2] == outs[1]


def test_tensor_parallel_shards_qwen3_moe_experts_and_replicates_qk_norm(tmp_path):
    from kvflow.model.sharding import check_tp_size, load_shard, local_arch

    path = BUILDERS["qwen3_moe"](str(tmp_path / "qwen3_moe"))
    arch = load_arch_config(path)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_tp_size(dataclasses.replace(arch, num_attention_heads=6, num_key_value_heads=3), 3)
    shards = [load_shard(path, arch, torch.float32, r, 2) for r in range(2)]
    assert local_arch(arch, 2).moe_intermediate_size == arch.moe_intermediate_size // 2
    hf = hf_model(path).model.layers[0]
    for s in shards:  # QK-norm weights span one head and the router sees the whole hidden state
        assert torch.equal(s["layers.0.q_norm"], hf.self_attn.q_norm.weight)
        assert torch.equal(s["layers.0.moe.router"], hf.mlp.gate.weight)
    n = arch.moe_intermediate_size // 2
    full_gate_up = torch.cat([shards[0]["layers.0.moe.gate_up"][:, :n], shards[1]["layers.0.moe.gate_up"][:, :n]], 1)
    assert torch.equal(full_gate_up, hf.mlp.experts.gate_up_proj[:, :arch.moe_intermediate_size])
    assert torch.equal(torch.cat([s["layers.0.moe.down"] for s in shards], 2), hf.mlp.experts.down_proj)


_PREEMPTING_POOL = {"gpt_oss": 30}


@pytest.mark.parametrize("name", ["olmo2", "granite", "smollm3", "gpt_oss"])
def test_new_family_keeps_hf_tokens_through_preemption_and_a_prefix_cache_hit(name, tmp_path):
    """A family added as one file: HF's greedy tokens through a prefix-cache hit (a prompt's
    first blocks reused from an earlier request) and preemptions (a pool too small for four
    requests at once), with a 16-token budget cutting the prompts into chunks."""
    from kvflow import LLM, SamplingParams

    path = BUILDERS[name](str(tmp_path / "hf"))
    hf = hf_model(path)
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, 320, 24).tolist()
    prompts = [prefix + rng.integers(4, 320, n).tolist() for n in (5, 9, 3, 7)]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.logits]))
    trace = tmp_path / "trace.jsonl"
    # a pool that fits one request and not four; gpt-oss's sliding layers are a second KV cache
    # group that takes its own share of it
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_blocks=_PREEMPTING_POOL.get(name, 22),
              max_num_batched_tokens=16, trace=str(trace))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and rest[0].num_cached_tokens == 24  # the shared 6 blocks
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["preempted"] for s in steps), "the pool should have forced a preemption"
    identical = 0
    for i, out in enumerate([first, *rest]):
        got = out.outputs[0].token_ids
        assert_matches_reference(got, refs[i], f"{name} prompt {i}")
        identical += got == refs[i][0]
    assert identical >= len(prompts) - 1


def test_granite_q8_0_gguf_is_served_as_stored_with_its_multipliers(tmp_path, monkeypatch):
    """llama.cpp's granite keys give the four multipliers, the projections stay Q8_0 (the
    family declares quantized weights), and the greedy tokens follow HF's within its top 3."""
    from kvflow import LLM, SamplingParams
    from kvflow.models.granite import GraniteForCausalLM

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = BUILDERS["granite"](str(tmp_path / "hf"))
    gguf_path = write_gguf(path, str(tmp_path / "q8.gguf"), quant="Q8_0")
    model, arch = load_model(gguf_path, torch.float32, quantization="gguf")
    assert type(model) is GraniteForCausalLM and model.layers[0].packed["qkv_proj"].quant is not None
    hf_arch = load_arch_config(path)
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert getattr(arch, key) == pytest.approx(getattr(hf_arch, key)) != 1.0, key
    hf = hf_model(path)
    ids = np.random.default_rng(0).integers(4, 320, 12).tolist()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ref = (out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.logits])
    llm = LLM(gguf_path, dtype="float32", max_model_len=64, num_blocks=32)  # the file's tokenizer
    got = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert_matches_reference(got, ref, "granite Q8_0", min_agree=1)
