"""gpt-oss as published, its experts in MXFP4 (tests/mxfp4_models.py writes the tiny one), and
the same model converted by llama.cpp's converter to a GGUF file: served as stored, each gives
transformers' fp32 logits on the dequantised experts over chunked mixed batches and its greedy
tokens through the engine; the experts occupy the checkpoint's MXFP4 bytes, never floats; what
cannot run with them is refused by name."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import NEW_TOKENS
from conftest_model_helpers import PagedDriver, hf_logits
from mxfp4_models import dequantised_hf_model, save_gpt_oss_mxfp4, write_gpt_oss_gguf
from kvflow.model.loader import load_model
from kvflow.model.quant.qlinear import available_isas

pytestmark = pytest.mark.slow  # loads models (make test-fast leaves it out)

torch.set_num_threads(1)
# int8 activations (per block of 32) against the exact MXFP4 weights: logits within this of
# the float reference's (6e-4 seen; the logits spread about 0.17)
ATOL = 3e-3
SEQ_LENS = {"a": 21, "b": 9, "c": 1, "d": 14}
PLAN = [{"c": 1, "d": 6, "b": 5}, {"c": 1, "d": 8, "a": 7, "b": 4},
        {"a": 9, "c": 1, "d": 1}, {"a": 5, "b": 1, "d": 1}, {"a": 1, "b": 1, "c": 1}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(MXFP4 folder, HF reference on the dequantised experts, kvflow model, arch)."""
    path = save_gpt_oss_mxfp4(str(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf"))
    model, arch = load_model(path, torch.float32, quantization="mxfp4")
    return path, dequantised_hf_model(path), model, arch


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory):
    """(GGUF path, HF reference with llama.cpp's fixed SwiGLU limit 7, which the file cannot
    carry: the tiny model's own 0.2 is not a GGUF key). Its conversion cache in a temp folder."""
    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_CACHE_DIR", str(folder / "cache"))
        yield write_gpt_oss_gguf(tiny[0], str(folder / "gpt-oss.gguf")), dequantised_hf_model(tiny[0], swiglu_limit=7.0)


def _run_plan(model, arch, hf, atol: float) -> None:
    """The chunked mixed batches of PLAN: every row's logits against transformers'."""
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, 320, n + 3).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf, ids) for sid, ids in tokens.items()}
    driver = PagedDriver(model, arch, seed=7)
    done = dict.fromkeys(SEQ_LENS, 0)
    for step in PLAN:
        out = driver.step([(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()])
        for sid, n in step.items():
            got, want = out[sid], refs[sid][done[sid]: done[sid] + n]
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            done[sid] += n
    assert done == {"a": 22, "b": 11, "c": 4, "d": 16}


def test_experts_occupy_the_checkpoints_mxfp4_bytes(tiny):
    """Every expert is an MXFP4 panel weight of 4.25 bits a weight, the experts' bytes are the
    file's blocks and scales, and no float expert tensor exists (they stay on the meta device)."""
    from safetensors import safe_open

    path, _, model, arch = tiny
    h, inter, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        stored = sum(int(np.prod(f.get_slice(n).get_shape())) for n in f.keys()
                     if n.endswith(("_blocks", "_scales")))  # uint8: one byte each
    assert model.quant_report["expert_bytes"] == stored == arch.num_hidden_layers * e * 3 * h * inter * 17 // 32
    for layer in model.layers:
        moe = layer.moe
        assert moe.gate_up.is_meta and moe.down.is_meta
        for pk in moe.packed_experts:
            assert pk["gate_up"].quant.kind == pk["down"].quant.kind == "mxfp4"
            assert pk["gate_up"].quant.packed.dtype == torch.uint8
            assert (pk["gate_up"].quant.n, pk["gate_up"].quant.k) == (2 * inter, h)
            assert (pk["down"].quant.n, pk["down"].quant.k) == (h, inter)
            assert pk["gate_up"].quant.nbytes == 2 * inter * h * 17 // 32
    floats = sum(p.numel() for p in model.parameters() if not p.is_meta)
    assert floats == arch.num_parameters() - arch.num_hidden_layers * e * 3 * h * inter
    assert model.kernels.names["experts"].startswith("mxfp4-")


def test_logits_match_transformers_over_chunked_mixed_batches(tiny):
    """Prompts arriving in chunks beside decodes: each row's logits are transformers' fp32
    model's on the dequantised experts, and its top token the same."""
    _, hf, model, arch = tiny
    _run_plan(model, arch, hf, ATOL)


def test_llama_cpp_gguf_serves_the_same_mxfp4_bytes(tiny, gguf_file):
    """llama.cpp's gpt-oss file (`--quantization gguf`, its default): the experts' panels are
    byte for byte the HF folder's, the arch the folder's (YaRN from llama.cpp's keys, the even
    layers sliding), and the logits transformers' over chunked mixed batches."""
    import dataclasses

    path, _, folder_model, folder_arch = tiny
    gguf_path, hf = gguf_file
    model, arch = load_model(gguf_path, torch.float32, quantization="gguf")
    for ours, theirs in zip(model.layers, folder_model.layers):
        for a, b in zip(ours.moe.packed_experts, theirs.moe.packed_experts):
            assert torch.equal(a["gate_up"].quant.packed, b["gate_up"].quant.packed)
            assert torch.equal(a["down"].quant.packed, b["down"].quant.packed)
    differ = {k for k, v in dataclasses.asdict(arch).items() if v != dataclasses.asdict(folder_arch)[k]}
    assert differ == {"name", "rms_norm_eps", "swiglu_limit"}  # file name, fp32 epsilon, llama.cpp's 7
    assert abs(arch.rms_norm_eps - folder_arch.rms_norm_eps) < 1e-9 and arch.swiglu_limit == 7.0
    _run_plan(model, arch, hf, ATOL)


def test_llama_cpp_gguf_dequantised_is_transformers_model(gguf_file):
    """`--quantization none`: the experts dequantised by the gguf package give transformers'
    logits to float rounding (the same values as its dequantisation of the HF blocks)."""
    gguf_path, hf = gguf_file
    model, arch = load_model(gguf_path, torch.float32, quantization="none")
    assert not model.layers[0].moe.gate_up.is_meta
    _run_plan(model, arch, hf, 1e-4)


@pytest.mark.parametrize("isa", available_isas())
def test_each_kernel_path_serves_the_model(tiny, isa, monkeypatch):
    """The experts packed for each path this machine has (as a CPU with only AVX2, or none,
    would choose at load) give the same logits, and the start-up line names the path."""
    import kvflow.model.quant.mxfp4_load as mxfp4_load

    path, hf, _, arch = tiny
    monkeypatch.setattr(mxfp4_load, "best_isa", lambda features: isa)
    model, _ = load_model(path, torch.float32, quantization="mxfp4")
    assert model.kernels.names["experts"] == f"mxfp4-{isa}"
    assert all(pk["down"].quant.isa == isa for layer in model.layers for pk in layer.moe.packed_experts)
    ids = np.random.default_rng(3).integers(0, 320, 12).tolist()
    got = PagedDriver(model, arch).step([("a", ids)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_bf16_model_follows_the_reference(tiny):
    """dtype bfloat16 (what `auto` picks on CPUs with native bf16): the experts take bf16
    activations; logits within bf16's rounding of the fp32 reference, the same top token."""
    path, hf, _, arch = tiny
    model, _ = load_model(path, torch.bfloat16, quantization="mxfp4")
    ids = np.random.default_rng(4).integers(0, 320, 30).tolist()
    got = PagedDriver(model, arch).step([("a", ids)])["a"].float()
    want = hf_logits(hf, ids)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)  # 6e-3 seen
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_match_transformers_through_the_engine_with_chunked_prefill(tiny, gguf_file, source):
    """LLM on the MXFP4 folder (its quantization read from config.json) or llama.cpp's file, four
    prompts in 16-token chunks beside decodes: greedy tokens equal transformers' generate() on
    the dequantised experts over 32 steps."""
    from kvflow import LLM, SamplingParams

    path, hf = (tiny[0], tiny[1]) if source == "hf" else gguf_file
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((37, 5, 19, 2))]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(ids):].tolist())
    llm = LLM(path, dtype="float32", max_model_len=128, num_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.core.executor.runner.model.kernels.names["experts"].startswith("mxfp4-")
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_without_c_kernels_the_experts_are_dequantised_exactly(tiny):
    """No kernel library: the experts load as floats equal to transformers' dequantisation."""
    from kvflow.model.kernels import KernelOptions, select_kernels

    path, hf, _, arch = tiny
    kernels = select_kernels(torch.float32, options=KernelOptions(c_kernels=False))
    model, _ = load_model(path, torch.float32, kernels=kernels, quantization="mxfp4")
    inter = arch.moe_intermediate_size
    for ours, theirs in zip(model.layers, hf.model.layers):
        experts = theirs.mlp.experts
        assert torch.equal(ours.moe.gate_up[:, :inter], experts.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(ours.moe.gate_up[:, inter:], experts.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(ours.moe.down, experts.down_proj.transpose(1, 2))


def test_what_mxfp4_cannot_run_with_is_refused_by_name(tiny):
    from kvflow import LLM
    from kvflow.model.quant.load import resolve_quantization

    path = tiny[0]
    assert resolve_quantization(None, path) == "mxfp4"
    with pytest.raises(ValueError, match=r"model config \(mxfp4\) does not match .*\(int8\)"):
        resolve_quantization("int8", path)
    with pytest.raises(ValueError, match="not sharded across ranks"):
        resolve_quantization(None, path, tp_size=2)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization(None, path, on_gpu=True)
    with pytest.raises(ValueError, match="does not match"):
        load_model(path, torch.float32)  # quantization none: the checkpoint says otherwise
    with pytest.raises(ValueError, match="does not match"):
        LLM(path, dtype="float32", quantization="none")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_mxfp4_load_peaks_near_the_files_size(fmt, tmp_path, monkeypatch):
    """A gpt-oss MXFP4 checkpoint whose experts dominate (the folder: 238 MB, 214 MB of experts
    and 24 MB of bf16 floats; llama.cpp's file of it: 262 MB, its floats F32) loads in a fresh
    process with its RSS peak at most 1.15x the file plus 96 MiB above the runtime's (the
    floats' packed copies beside them, one expert's packing buffers, library pages touched by
    the load): no second copy of the experts exists at any point (1.39x and 1.27x measured).
    Read through a mapping of the file kept whole, each expert packed into a tensor of its own,
    the peaks were 2.0x and 2.27x."""
    import torch

    from mxfp4_models import measure_load_rss, save_random_gpt_oss_mxfp4, write_gpt_oss_gguf

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = save_random_gpt_oss_mxfp4(str(tmp_path / "big"),
                                     float_dtype=torch.float32 if fmt == "gguf" else torch.bfloat16)
    if fmt == "gguf":
        path = write_gpt_oss_gguf(path, str(tmp_path / "big.gguf"))
    r = measure_load_rss(path)
    file_bytes = r["file_bytes"]
    assert file_bytes > 200e6 and r["expert_bytes"] > 0.8 * file_bytes  # the experts dominate
    peak = r["peak"] - r["before"]
    assert peak <= 1.15 * file_bytes + (96 << 20), f"peak {peak / 1e6:.0f} MB for a {file_bytes / 1e6:.0f} MB file"
    assert peak >= r["expert_bytes"]  # measured at all: the experts' panels are resident
