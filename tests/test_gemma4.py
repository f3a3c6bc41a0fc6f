"""Gemma 4 (text) against Hugging Face transformers on tiny random models
(tiny_arch_models.GEMMA4_BUILDERS): one with per-layer embeddings, KV shared across its last
layers, k = v full layers of another head size and the double-wide MLP; one with the expert
block beside the dense MLP. fp32 logits over chunked mixed batches, greedy tokens through the
engine with chunked prefill, a prefix-cache hit and preemptions, the text part of a
Gemma4ForConditionalGeneration folder, the KV budget counting only the layers that own a
cache, and each model converted to GGUF as llama.cpp's converter writes it (the same logits and
greedy tokens from the file)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_matches_reference
from conftest_model_helpers import PagedDriver, hf_logits
from tiny_arch_models import GEMMA4_BUILDERS, GEMMA4_WINDOW, hf_model, write_gemma4_gguf
from kvflow.core.kv_cache.groups import make_kv_cache_groups
from kvflow.model.arch import load_arch_config
from kvflow.model.loader import load_model

torch.set_num_threads(1)
ATOL = 1e-4
SEQ_LENS = {"a": 21, "b": 9, "c": 1, "d": 14}
# c and d finish their prompts first and decode while a and b arrive in chunks
PLAN = [{"c": 1, "d": 6, "b": 5}, {"c": 1, "d": 8, "a": 7, "b": 4},
        {"a": 9, "c": 1, "d": 1}, {"a": 5, "b": 1, "d": 1}, {"a": 1, "b": 1, "c": 1}]


@pytest.fixture(scope="module", params=list(GEMMA4_BUILDERS))
def tiny(request, tmp_path_factory):
    """(name, HF folder, HF model)."""
    path = GEMMA4_BUILDERS[request.param](str(tmp_path_factory.mktemp(request.param) / "hf"))
    return request.param, path, hf_model(path)


def _run_plan(model, arch, hf) -> None:
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, 320, n + 3).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf, ids) for sid, ids in tokens.items()}
    driver, done = PagedDriver(model, arch, seed=7), dict.fromkeys(SEQ_LENS, 0)
    for step in PLAN:
        out = driver.step([(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()])
        for sid, n in step.items():
            torch.testing.assert_close(out[sid], refs[sid][done[sid]: done[sid] + n], atol=ATOL, rtol=1e-4)
            done[sid] += n
    assert done == {"a": 22, "b": 11, "c": 4, "d": 16}  # every prompt whole (a past the window), then decodes


@pytest.mark.slow
def test_logits_match_hf_over_chunked_mixed_batches(tiny):
    name, path, hf = tiny
    model, arch = load_model(path, torch.float32)
    assert arch.architecture == "Gemma4ForCausalLM"
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert GEMMA4_WINDOW in arch.layer_windows() and None in arch.layer_windows()
    assert set(arch.layer_head_dims) == {16, 32} and arch.attention_k_eq_v
    if name == "gemma4":
        assert arch.per_layer_input_size == 8 and arch.final_logit_softcapping == 30.0
        assert [layer.owns_kv for layer in model.layers] == [True] * 4 + [False] * 2
        assert model.layers[5].down_proj.shape[1] == 2 * arch.intermediate_size  # double-wide
    else:
        assert all(layer.moe is not None for layer in model.layers)
    _run_plan(model, arch, hf)


@pytest.mark.slow
def test_gguf_conversion_loads_to_the_same_model(tiny, tmp_path, monkeypatch):
    """llama.cpp's gemma4 file of each model: the same config as the folder's and the same
    weights (norms as stored, the experts' and router's scales, rope_freqs' partial rotation),
    so the same logits over the chunked plan."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    name, path, hf = tiny
    gguf_path = write_gemma4_gguf(path, str(tmp_path / f"{name}.gguf"))
    model, arch = load_model(gguf_path, torch.float32)
    folder = load_arch_config(path)
    same = ("architecture", "layer_types", "sliding_window", "head_dim", "num_key_value_heads",
            "layer_head_dims", "layer_kv_heads", "rope_per_type", "per_layer_input_size",
            "per_layer_vocab_size", "num_kv_shared_layers", "attention_k_eq_v", "double_wide_mlp",
            "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "tie_word_embeddings", "final_logit_softcapping", "qk_norm", "rotary_dim")
    assert {f: getattr(arch, f) for f in same} == {f: getattr(folder, f) for f in same}
    assert arch.num_parameters() == folder.num_parameters()
    _run_plan(model, arch, hf)


def test_f16_gguf_loads_its_weights_as_stored(tmp_path, monkeypatch):
    """An F16 file (matrices F16, vectors F32, as the converter writes them): every weight is
    the folder's rounded to fp16, the norms and scales exact."""
    from safetensors.torch import load_file

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = GEMMA4_BUILDERS["gemma4_moe"](str(tmp_path / "hf"))
    model, _ = load_model(write_gemma4_gguf(path, str(tmp_path / "f16.gguf"), dtype="F16"), torch.float32)
    hf = load_file(f"{path}/model.safetensors")
    layer = model.layers[1]
    assert torch.equal(layer.moe.gate_up, hf["model.layers.1.experts.gate_up_proj"].half().float())
    assert torch.equal(layer.moe.per_expert_scale, hf["model.layers.1.router.per_expert_scale"])
    assert torch.equal(layer.pre_feedforward_layernorm_2, hf["model.layers.1.pre_feedforward_layernorm_2.weight"])
    assert torch.equal(layer.layer_scalar, hf["model.layers.1.layer_scalar"])


@pytest.mark.slow
def test_conditional_generation_folder_loads_its_text_part(tmp_path):
    """A Gemma4ForConditionalGeneration folder (the text config nested, the language model's
    tensors under model.language_model., a vision tensor beside them) runs its text part."""
    from safetensors.torch import load_file, save_file

    path = GEMMA4_BUILDERS["gemma4"](str(tmp_path / "hf"))
    hf = hf_model(path)
    with open(f"{path}/config.json") as f:
        text = json.load(f)
    folder = tmp_path / "vlm"
    folder.mkdir()
    with open(folder / "config.json", "w") as f:
        json.dump({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                   "text_config": {**text, "architectures": None}, "tie_word_embeddings": True}, f)
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(f"{path}/model.safetensors").items()}
    tensors["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model, arch = load_model(str(folder), torch.float32)
    assert arch.architecture == "Gemma4ForCausalLM" and arch.num_kv_shared_layers == 2
    _run_plan(model, arch, hf)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_engine_keeps_hf_tokens_through_chunks_a_prefix_hit_and_preemption(tiny, fmt, tmp_path, monkeypatch):
    """Greedy tokens through the engine equal HF's, from the folder and from its GGUF file: a
    16-token budget cuts the prompts into chunks, four requests of different lengths run as one
    mixed batch after a first one, two of them sharing its 48-token prefix (a prefix-cache hit,
    recorded), and a pool too small for all of them at once forces a preemption."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    name, path, hf = tiny
    if fmt == "gguf":
        path = write_gemma4_gguf(path, str(tmp_path / f"{name}.gguf"))
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, 320, 48).tolist()
    prompts = [prefix + rng.integers(4, 320, 5).tolist(), prefix + rng.integers(4, 320, 9).tolist(),
               rng.integers(4, 320, 30).tolist(), prefix + rng.integers(4, 320, 3).tolist(),
               rng.integers(4, 320, 7).tolist()]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].topk(3).indices.tolist() for s in out.logits]))
    trace = tmp_path / "trace.jsonl"
    arch = load_arch_config(path)
    groups = make_kv_cache_groups(arch.kv_layer_windows(), arch.kv_layer_shapes())
    # 80 positions in each KV cache group (a token takes a block's slot in each)
    llm = LLM(path, dtype="float32", max_model_len=96, block_size=4, num_blocks=20 * len(groups),
              max_num_batched_tokens=16, trace=str(trace))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and rest[0].num_cached_tokens == 48
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["preempted"] for s in steps), "the pool should have forced a preemption"
    assert all(s["num_scheduled_tokens"] <= 16 for s in steps)
    assert max(len(s["requests"]) for s in steps) >= 3  # a mixed batch
    identical = 0
    for i, out in enumerate([first, *rest]):
        got = out.outputs[0].token_ids
        assert_matches_reference(got, refs[i], f"{name} prompt {i}")
        identical += got == refs[i][0]
    assert identical >= len(prompts) - 1
    runner = llm.engine.core.executor.runner
    owners = arch.attention_layers()
    assert all((runner.kv_caches[i] is None) == (i not in owners) for i in range(len(runner.kv_caches)))


def _own_kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """K and V of one token in every layer that owns a cache, each at its own shape, from
    config.json as transformers writes it (each full layer's head size and, where they differ,
    kv heads in `per_layer_config`)."""
    n, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers") or 0
    per_layer = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}  # "04", "34"
    total = 0
    for i in range(n - shared):
        own = per_layer.get(i, {})
        kv = own.get("num_key_value_heads", config["num_key_value_heads"])
        total += 2 * kv * own.get("head_dim", config["head_dim"]) * dtype_bytes
    return total


def test_kv_budget_counts_only_the_layers_that_own_a_cache(tmp_path):
    """Six layers, the last two sharing KV with layers 2 and 3 (the ones transformers picks):
    KV bytes per token and the scheduler's KV cache groups count the four owners only, each
    at its own head size and kv heads (sliding: 16 x 2, full: 32 x 1)."""
    from transformers import Gemma4TextConfig

    from tiny_arch_models import _gemma4_config

    cfg = _gemma4_config(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                         num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=320,
                         attention_k_eq_v=True, num_global_key_value_heads=1)
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    arch = load_arch_config(str(tmp_path))
    assert arch.attention_layers() == [0, 1, 2, 3]
    assert [arch.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    modes = Gemma4TextConfig.from_pretrained(tmp_path).kv_sharing_modes
    assert [i for i, m in enumerate(modes) if m == "store"] == [2, 3]  # transformers' producers
    assert arch.kv_layer_shapes() == [(2, 16), (1, 32)] * 2
    with open(tmp_path / "config.json") as f:
        assert arch.kv_bytes_per_token(2) == _own_kv_bytes_per_token(json.load(f), 2) == 4 * 2 * 32 * 2
    groups = make_kv_cache_groups(arch.kv_layer_windows(), arch.kv_layer_shapes())
    assert sorted(i for g in groups for i in g.layers) == [0, 1, 2, 3]
    assert {(g.num_kv_heads, g.head_size) for g in groups} == {(2, 16), (1, 32)}


def test_per_layer_config_keys_are_read_as_transformers_writes_them(tmp_path):
    """transformers writes `per_layer_config`'s keys zero-padded past nine layers ("04" beside
    "11"): every full layer still gets its head size (Gemma 4 E2B has 35 layers)."""
    from tiny_arch_models import _gemma4_config

    types = (["sliding_attention"] * 3 + ["full_attention"]) * 3
    cfg = _gemma4_config(num_hidden_layers=12, layer_types=types, num_kv_shared_layers=4,
                         hidden_size_per_layer_input=0)
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert "03" in json.load(f)["per_layer_config"]
    arch = load_arch_config(str(tmp_path))
    assert arch.layer_head_dims == [32 if t == "full_attention" else 16 for t in types]
    assert arch.kv_layer_shapes() == [(2, 32) if t == "full_attention" else (2, 16) for t in types[:8]]


@pytest.mark.parametrize("name", list(GEMMA4_BUILDERS))
def test_engine_kv_cache_is_sized_per_layer(name, tmp_path):
    """The engine's KV bytes per token (the start-up line's) is the sum of the cache-owning
    layers' own K/V sizes, computed here from config.json; each owner's cache has its own
    shape, and the pool's memory is exactly that per token of each KV cache group (no padding
    to the widest head: in gemma4_moe the full layers' pages hold two sliding layers' each)."""
    from kvflow import LLM

    path = GEMMA4_BUILDERS[name](str(tmp_path / "hf"))
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    expected = _own_kv_bytes_per_token(config, 4)
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_blocks=12, warmup=False)
    core = llm.engine.core
    assert core.kv_bytes_per_token == expected
    assert f"KV float32 {expected} B/token" in core.startup_report()
    arch, runner = core.arch, core.executor.runner
    for i, (kv, d) in zip(arch.attention_layers(), arch.kv_layer_shapes()):
        assert runner.kv_caches[i][0].shape[1:] == (kv, 4, d)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for pair in runner.kv_caches if pair is not None for t in pair}
    groups = make_kv_cache_groups(core.cache_config.layer_windows, core.cache_config.layer_kv_shapes)
    assert sum(storages.values()) == 12 * 4 * expected // len(groups)
    if name == "gemma4_moe":
        assert max(g.pages_per_slot for g in groups) == 2


def test_what_gemma4_cannot_run_with_is_refused_by_name(tmp_path):
    """Tensor and pipeline parallelism and LoRA name the family; bidirectional attention is
    refused at the config."""
    from kvflow.models.registry import family_of

    supports = family_of("Gemma4ForCausalLM").supports
    with pytest.raises(ValueError, match="Gemma 4 does not run tensor-parallel"):
        supports.check("Gemma 4", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="Gemma 4 does not run pipeline-parallel"):
        supports.check("Gemma 4", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="Gemma 4 does not take LoRA"):
        supports.check("Gemma 4", lora=True)
    assert not supports.decode_step and not supports.quantized
    from tiny_arch_models import _gemma4_config

    cfg = _gemma4_config(use_bidirectional_attention="all")
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.save_pretrained(tmp_path / "bidi")
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_arch_config(str(tmp_path / "bidi"))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_one_byte_kv_caches_keep_their_layout_rules(kv_cache_dtype, tmp_path):
    """fp8 keeps each layer's own shape (one byte a value: the owners' own sizes); int8's
    per-token scales after each tile make the sliding and full pages no multiples of each
    other, so every layer takes the widest shape (head 32 + 4 scale bytes, two kv heads) and
    pads to it. Both serve the tiny model's requests."""
    from kvflow import LLM, SamplingParams

    path = GEMMA4_BUILDERS["gemma4_moe"](str(tmp_path / "hf"))
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_blocks=24,
              kv_cache_dtype=kv_cache_dtype, warmup=False)
    core = llm.engine.core
    owners = core.arch.attention_layers()
    expected = (_own_kv_bytes_per_token(config, 1) if kv_cache_dtype == "fp8"
                else len(owners) * 2 * 2 * (32 + 4))
    assert core.kv_bytes_per_token == expected
    shapes = {tuple(core.executor.runner.kv_caches[i][0].shape[1:]) for i in owners}
    assert shapes == ({(2, 4, 16), (2, 4, 32)} if kv_cache_dtype == "fp8" else {(2, 4, 36)})
    out = llm.generate([[5, 6, 7, 8, 9] * 4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_sdpa_path_reads_each_layers_own_cache_shape(tmp_path, monkeypatch):
    """With the PyTorch paths (KVFLOW_NO_KERNELS=1: SDPA attention, the Python KV write) the
    packed layout (gemma4_moe: two sliding layers to a full layer's page) gives HF's greedy
    tokens through chunked prefill and a mixed batch, as the C kernels do."""
    from kvflow import LLM, SamplingParams

    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    path = GEMMA4_BUILDERS["gemma4_moe"](str(tmp_path / "hf"))
    hf = hf_model(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, 320, 30).tolist(), rng.integers(4, 320, 11).tolist()]
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_blocks=60,
              max_num_batched_tokens=16, warmup=False)
    assert llm.engine.core.executor.runner.model.kernels.names["attention"] == "sdpa"
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    with torch.inference_mode():
        for ids, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
