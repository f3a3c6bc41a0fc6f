"""Greedy tokens under LoRA adapters equal Hugging Face PEFT's merged model (`merge_and_unload`)
for three random adapters (different ranks, rslora, a subset of the projections), each alone and
all three beside the base model in one batch, on a tiny random Llama and on the default model
(fp32); quantized base weights (the default model's Q4_1 served as stored, int8 W8A8) with a
float adapter follow the float model with that adapter."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import MIN_AGREE_BF16, assert_matches_reference
from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3
from kvflow import LLM, LoRARequest, SamplingParams
from lora_helpers import merged_greedy, save_random_adapter

pytestmark = pytest.mark.slow  # loads models

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# (rank, alpha, rslora, targets): all seven projections, rslora, attention + down only
ADAPTERS = [(8, 16, False, None), (4, 8, True, None), (16, 16, False, ["q_proj", "v_proj", "down_proj"])]


def _adapters(base, root, b_scale: float) -> list[str]:
    return [save_random_adapter(base, str(root / f"adapter{i}"), seed=10 + i, r=r, alpha=a,
                                rslora=rs, targets=t, b_scale=b_scale)
            for i, (r, a, rs, t) in enumerate(ADAPTERS)]


def _check_alone_and_mixed(llm: LLM, prompts, paths, refs) -> None:
    lrs = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    for lr, path in zip(lrs, paths):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lr)
        for j, out in enumerate(outs):
            assert_matches_reference(out.outputs[0].token_ids, refs[path][j], f"{lr.lora_name} prompt {j}")
    # all three and the base model in one batch: spy on the steps' adapter rows
    seen = []
    manager = llm.engine.core.executor.runner.lora
    step = manager.step

    def spy(ids, query_lens):
        seen.append(set(ids))
        return step(ids, query_lens)
    manager.step = spy
    try:
        order = [None, *lrs]
        outs = llm.generate([p for p in prompts for _ in order], GREEDY, use_tqdm=False,
                            lora_request=[lr for _ in prompts for lr in order])
    finally:
        manager.step = step
    assert any(s == {0, 1, 2, 3} for s in seen), "the base model and the 3 adapters never shared a step"
    for k, out in enumerate(outs):
        j, lr = divmod(k, len(order))
        ref = refs[None if order[lr] is None else paths[lr - 1]][j]
        assert_matches_reference(out.outputs[0].token_ids, ref, f"mixed: prompt {j} adapter {lr}")
    # the adapters do change the outputs (a test that cannot fail proves nothing)
    for p in paths:
        assert any(refs[p][j][0] != refs[None][j][0] for j in range(len(prompts))), p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny_lora")
    path = save_tiny_llama3(str(root / "base"))
    save_byte_tokenizer(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    paths = _adapters(base, root, b_scale=0.05)
    prompts = [[5, 17, 99, 200, 33, 7], [40, 41, 42], list(range(10, 70))]
    refs = {p: merged_greedy(base, p, prompts, NEW) for p in [None, *paths]}
    return path, paths, prompts, refs


def test_tiny_llama_adapters_match_peft_merged(tiny):
    path, paths, prompts, refs = tiny
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              num_blocks=128, max_model_len=256, max_num_batched_tokens=64)
    _check_alone_and_mixed(llm, prompts, paths, refs)


def test_tiny_llama_embeddings_under_adapters_match_peft_merged(tiny):
    """LLM.embed with a lora_request pools the merged model's last hidden state; one call may
    mix the base model and adapters (prompts chunked: 60 tokens in steps of 16)."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, paths, prompts, _ = tiny
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def reference(adapter: str | None) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        with torch.inference_mode():
            last = [model.model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in prompts]
        return [torch.nn.functional.normalize(v, dim=0).numpy() for v in last]

    refs = {p: reference(p) for p in [None, *paths[:2]]}
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              num_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    lrs = [None, LoRARequest("a0", 1, paths[0]), LoRARequest("a1", 2, paths[1])]
    order = [(j, k) for j in range(len(prompts)) for k in range(len(lrs))]
    outs = llm.embed([prompts[j] for j, _ in order], use_tqdm=False,
                     lora_request=[lrs[k] for _, k in order])
    for (j, k), out in zip(order, outs):
        ref = refs[None if lrs[k] is None else lrs[k].lora_path][j]
        got = np.asarray(out.outputs.embedding)
        assert np.abs(got - ref).max() < 1e-4, f"prompt {j} adapter {k}"
    # the adapters change the embeddings (a test that cannot fail proves nothing)
    for p in paths[:2]:
        assert all(np.abs(refs[p][j] - refs[None][j]).max() > 1e-2 for j in range(len(prompts)))
    one = llm.embed(prompts[0], use_tqdm=False, lora_request=lrs[1])[0].outputs.embedding
    assert np.abs(np.asarray(one) - refs[paths[0]][0]).max() < 1e-4
    plain = LLM(path, dtype="float32", num_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.embed(prompts[0], use_tqdm=False, lora_request=lrs[1])


def test_tiny_llama_adapters_match_without_c_kernels(tiny, monkeypatch):
    """The PyTorch path (no C kernels) gives the same tokens."""
    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    path, paths, prompts, refs = tiny
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, num_blocks=64, max_model_len=256)
    assert llm.engine.core.executor.runner.model.kernels.lora.__name__ == "_lora_torch"
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, paths[0]))
    for j, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, refs[paths[0]][j], f"prompt {j}")


def test_max_cpu_loras_drops_the_least_recently_used_and_reads_it_again(tiny):
    """With max_cpu_loras 2, a third adapter drops the least recently used one from host
    memory; its next request reads it from its folder again, with the same tokens."""
    path, paths, prompts, refs = tiny
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2,
              num_blocks=64, max_model_len=256)
    lrs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    core = llm.engine.core
    for lr in lrs:
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lr)
    assert core.list_loras() == [2, 3]  # 1 was the least recently used
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lrs[0])
    for j, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, refs[paths[0]][j], f"prompt {j}")
    assert core.list_loras() == [1, 3]


@pytest.fixture(scope="module")
def default_case(tmp_path_factory, default_model_path, prompt_ids):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    folder, fname = os.path.split(default_model_path)
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    root = tmp_path_factory.mktemp("default_lora")
    paths = _adapters(base, root, b_scale=0.04)
    prompts = [prompt_ids[0], prompt_ids[4]]
    refs = {p: merged_greedy(base, p, prompts, NEW) for p in [None, *paths]}
    del base
    return paths, prompts, refs


def test_default_model_adapters_match_peft_merged(default_model_path, default_case):
    paths, prompts, refs = default_case
    llm = LLM(default_model_path, dtype="float32", quantization="none", enable_lora=True,
              max_loras=3, num_blocks=128, max_model_len=512)
    _check_alone_and_mixed(llm, prompts, paths, refs)


def _teacher_forced_logits(model, ids: list[int], lora=None) -> torch.Tensor:
    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches

    bs = 16
    caches = allocate_kv_caches(model.arch, -(-len(ids) // bs), bs, model.dtype)
    meta = build_attention_metadata(np.array([len(ids)]), np.array([len(ids)]),
                                    [list(range(-(-len(ids) // bs)))], bs)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches, meta,
                                          lora=lora))


def _with_adapter(model, arch, path: str, ids: list[int]):
    from kvflow.model.lora import LoRAManager

    manager = LoRAManager(model, arch, max_loras=1, max_lora_rank=16)
    manager.add(LoRARequest("a", 1, path))
    return manager.step([1], np.array([len(ids)]))


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return (ref.argmax(-1) == got.argmax(-1)).float().mean().item(), (p.exp() * (p - q)).sum(-1).mean().item()


def _quantized_follows_float(model_path: str, adapter: str, ids: list[int], quantization: str) -> None:
    from kvflow.model.loader import load_model

    ref_model, arch = load_model(model_path, torch.float32, quantization="none")
    ref = _teacher_forced_logits(ref_model, ids, _with_adapter(ref_model, arch, adapter, ids))
    del ref_model
    model, arch = load_model(model_path, torch.float32, quantization=quantization)
    assert model.layers[0].packed["qkv_proj"].quant is not None
    base = _teacher_forced_logits(model, ids)
    got = _teacher_forced_logits(model, ids, _with_adapter(model, arch, adapter, ids))
    agree, kl = _agreement(ref, got)
    _, kl_base = _agreement(ref, base)
    assert agree >= 0.9 and kl < 0.02, (agree, kl)
    assert kl_base > 5 * kl, (kl_base, kl)


def test_gguf_base_with_a_float_adapter_follows_the_float_model(default_model_path,
                                                                default_tokenizer, default_case):
    """QLoRA-style serving: the default model's Q4_1 blocks as stored (int8 activations) plus a
    float adapter, teacher-forced, against the fp32 model with the same adapter: close to it
    (KL 0.003 when written), and far closer than the quantized model without the adapter."""
    ids = default_tokenizer.encode("The history of the city begins in the Roman era, when")[:48]
    _quantized_follows_float(default_model_path, default_case[0][0], ids, "gguf")


def test_int8_base_with_a_float_adapter_follows_the_float_model(tiny):
    """The same for int8 W8A8 of a float model (the tiny Llama: W8A8 of the default model
    itself is further from fp32 than its adapter's effect)."""
    path, paths, _, _ = tiny
    _quantized_follows_float(path, paths[0], list(range(3, 99)), "int8")


def test_quantized_base_serves_adapters_in_mixed_batches(default_model_path, default_case):
    """The Q4_1 model through the engine: a request under an adapter gives its tokens alone and
    beside another adapter's and the base model's requests, and they are not the base model's."""
    paths, prompts, _ = default_case
    llm = LLM(default_model_path, dtype="float32", enable_lora=True, max_loras=2, num_blocks=128,
              max_model_len=512)
    assert "linear=quant-" in llm.engine.core.startup_report()
    lr = LoRARequest("a", 1, paths[0])
    alone = llm.generate([prompts[0]], GREEDY, use_tqdm=False, lora_request=lr)[0].outputs[0].token_ids
    mixed = llm.generate([prompts[0], prompts[1], prompts[1]], GREEDY, use_tqdm=False,
                         lora_request=[lr, LoRARequest("b", 2, paths[1]), None])
    # int8 activations are quantized per row: the first tokens must agree, ties may differ later
    assert mixed[0].outputs[0].token_ids[:MIN_AGREE_BF16] == alone[:MIN_AGREE_BF16]
    base = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert base != alone
    assert mixed[2].outputs[0].token_ids[:MIN_AGREE_BF16] == llm.generate(
        [prompts[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:MIN_AGREE_BF16]
