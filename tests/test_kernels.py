"""The kernel backend is chosen once, from the CPU's features, the dtypes and the opt-outs, and
the model runs through the choice: the PyTorch paths give the same tokens as the C kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest_model_helpers import PagedDriver, save_tiny_llama3
from kvflow.csrc import library, ops
from kvflow.csrc.gemm import amx_panel_gemm, amx_panels_built, pack_panels, panel_gemm
from kvflow.model import packed_linear
from kvflow import attention as A
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.model.kernels import KernelOptions, select_kernels
from kvflow.attention.kv_layout import write_rows
from kvflow.model.loader import load_model

ZEN4 = CpuFeatures.from_names("avx2", "avx512f", "avx512_bf16")
SAPPHIRE_RAPIDS = CpuFeatures.from_names("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                         "amx_bf16", "amx_int8", "amx_tile")
AVX2 = CpuFeatures.from_names("avx2", "fma", "f16c")  # a Zen 3
ALL_ON = KernelOptions()
BUILT = library() is not None  # the C kernels compile here (gcc is part of the setup)
PANELS_BUILT = BUILT and bool(library().gemm_bf16_available())


def test_kvflow_no_kernels_gives_the_pytorch_paths(monkeypatch):
    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    k = select_kernels(torch.float32)
    assert not k.options.c_kernels
    assert k.attention is A.attention_with_sdpa and k.write_kv is write_rows
    assert k.add_rms_norm is ops.add_rms_norm_torch and k.rope is ops.rope_torch_
    assert k.silu_mul is ops.silu_mul_torch and k.argmax is ops.argmax_rows_torch
    assert k.names["attention"] == "sdpa" and k.names["norm"] == "torch"


def test_the_environment_is_read_when_the_kernels_are_chosen_not_per_call(monkeypatch):
    monkeypatch.delenv("KVFLOW_NO_KERNELS", raising=False)
    chosen = select_kernels(torch.float32)
    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    monkeypatch.setenv("KVFLOW_NO_ONEDNN", "1")
    assert chosen.options == ALL_ON  # what was chosen stays chosen
    assert select_kernels(torch.float32).options == KernelOptions(c_kernels=False, onednn=False)


@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_bf16_on_an_avx512_bf16_cpu_takes_the_panel_gemm_and_the_prompt_kernel():
    k = select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON)
    assert k.names["linear"] == "panel-bf16" and k.names["gate_up"] == "panel-bf16-silu"
    assert k.names["attention"] == "c-decode+c-prompt" and k.names["argmax"] == "c"
    assert k.attention == A.CAttention(torch.bfloat16, prompt_kernel=True)
    assert k.attention.decode_kernel == "paged_decode_bf16" and k.attention.prompt_kv_kind == 0
    packed = k.pack(torch.randn(128, 64).bfloat16(), gate_up=True)
    assert packed.panels is not None and packed.gate_up
    # a bf16 model over an fp32 cache: the prompt kernel reads bf16 caches only
    assert k.with_kv_dtype(torch.float32).names["attention"] == "c-decode"


@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_bf16_on_an_amx_cpu_takes_the_panels_for_few_rows_and_amx_for_more():
    k = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=ALL_ON)
    rows, large = packed_linear.AMX_PANEL_ROWS, packed_linear.AMX_PANEL_ROWS_LARGE
    # AMX's tiles read the panels where this build has them and Linux grants them (one copy
    # of the weights); else oneDNN's AMX GEMM keeps its own copy beside the panels
    tiles = amx_panels_built()
    amx = "amx-panels" if tiles else "onednn-amx"
    assert k.names["linear"] == f"panel-bf16<={rows},{large}+{amx}"
    assert k.names["gate_up"] == (f"panel-bf16-silu<={rows},{large}+amx-panels-silu" if tiles
                                  else f"panel-bf16-silu<={rows},{large}+onednn-amx+c-silu")
    assert k.describe().startswith(f"kernels [avx512-bf16]: linear=panel-bf16<={rows},{large}+{amx}, ")
    w = torch.randn(128, 64).bfloat16()
    packed = k.pack(w, gate_up=True)
    assert packed.panels is not None and (packed.onednn is None) == tiles and packed.panel_rows == rows
    # a weight past AMX_LARGE_BYTES (an LM head) streams from memory: the panels keep more rows
    head = torch.empty(packed_linear.AMX_LARGE_BYTES // 2 // 64 + 64, 64, dtype=torch.bfloat16)
    assert k.pack(head).panel_rows == large
    # the Zen 4 (no AMX) keeps the panels alone, and each opt-out leaves one copy
    zen4 = select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON).pack(w)
    assert zen4.onednn is None and zen4.panel_rows is None
    no_onednn = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=KernelOptions(onednn=False))
    assert no_onednn.names["linear"] == (f"panel-bf16<={rows},{large}+amx-panels" if tiles else "panel-bf16")
    assert no_onednn.pack(w).onednn is None
    # KVFLOW_NO_AMX_PANELS: oneDNN's AMX GEMM on its own copy beside the panels (two copies)
    copy = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=KernelOptions(amx_panels=False))
    assert copy.names["linear"] == f"panel-bf16<={rows},{large}+onednn-amx"
    assert copy.pack(w).onednn is not None and copy.pack(w).panels is not None
    no_panels = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=KernelOptions(panel_gemm=False))
    assert no_panels.names["linear"] == "onednn" and no_panels.pack(w).panels is None
    # fp32 is as before (the GEMV and oneDNN)
    assert select_kernels(torch.float32, features=SAPPHIRE_RAPIDS, options=ALL_ON).names["linear"] == "gemv-avx512+onednn"
    # prompt attention on AMX's tiles where this build has them and Linux grants them, unless
    # KVFLOW_NO_AMX_ATTENTION; never on a CPU without AMX
    granted = bool(library().prefill_amx_available())
    assert k.attention.prompt_amx == granted
    assert k.names["attention"] == "c-decode+c-prompt" + ("-amx" if granted else "")
    off = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=KernelOptions(amx_attention=False))
    assert off.attention.prompt_amx is False and off.names["attention"] == "c-decode+c-prompt"
    assert select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON).attention.prompt_amx is False
    # the decode kernel prefetches every block on a CPU with AMX (a Xeon), not on a Zen 4
    assert k.attention.prefetch_all is True and k.attention.decode_flags == 4
    assert select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON).attention.prefetch_all is False


@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_the_row_threshold_picks_the_panels_or_amx_and_both_agree():
    torch.manual_seed(0)
    rows = packed_linear.AMX_PANEL_ROWS
    k = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=ALL_ON)
    w, bias = (torch.randn(192, 128) * 0.1).bfloat16(), torch.randn(192).bfloat16()
    gate_up = (torch.randn(128, 128) * 0.1).bfloat16()
    packed, packed_gu = k.pack(w), k.pack(gate_up, gate_up=True)
    for m in (1, rows, rows + 1, 3 * rows + 5):
        x = torch.randn(m, 128).bfloat16()
        got = k.linear(x, w, packed, bias)
        panels = panel_gemm(x, packed.panels, 192, bias)
        amx = (amx_panel_gemm(x, packed.panels, 192, bias) if packed.onednn is None
               else torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], ""))
        assert torch.equal(got, panels if m <= rows else amx), m
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), bias.float()),
                                   atol=2e-2, rtol=2e-2)
        want = ops.silu_mul_torch(F.linear(x.float(), gate_up.float())).bfloat16()
        torch.testing.assert_close(k.linear_silu_mul(x, gate_up, packed_gu).float(), want.float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not BUILT, reason="no C compiler")
def test_the_kv_cache_dtype_binds_attention_and_the_kv_write_once():
    k = select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON)
    assert k.write_kv == A.CKVWriter(torch.bfloat16, torch.bfloat16) and k.write_kv.writer == "copy_kv_bf16"
    # a one-byte cache, known only when the runner allocates it: its decode kernel, path and
    # writer are bound then, not looked up per call
    int8 = k.with_kv_dtype(torch.int8)
    assert int8.attention.decode_kernel == "paged_decode_q8"
    assert int8.attention.q8_isa == A.best_q8_isa(ZEN4, torch.int8)
    assert int8.attention.decode_words == (A.Q8_KINDS[torch.int8], A.Q8_ISAS[int8.attention.q8_isa])
    assert int8.write_kv.writer == "write_kv_q8"
    assert select_kernels(torch.float32, torch.bfloat16, features=ZEN4,
                          options=ALL_ON).write_kv.writer == "write_kv_bf16"
    # a cache the C kernels do not read is SDPA's from the start
    fp16 = k.with_kv_dtype(torch.float16)
    assert fp16.attention is A.attention_with_sdpa and fp16.names["attention"] == "sdpa"
    with pytest.raises(ValueError, match="needs one of the paths"):
        A.CAttention(torch.int8)


@pytest.mark.skipif(not BUILT, reason="no C compiler")
def test_an_avx2_cpu_gets_no_panel_gemm_no_prompt_kernel_and_no_bf16_onednn():
    k = select_kernels(torch.bfloat16, features=AVX2, options=ALL_ON)
    assert k.names["linear"] == "torch" and k.pack is None  # oneDNN would emulate bf16
    assert k.names["attention"] == "c-decode"
    assert k.attention == A.CAttention(torch.bfloat16, prompt_kernel=False)
    f32 = select_kernels(torch.float32, features=AVX2, options=ALL_ON)
    # fp32: kvflow's AVX2 GEMV for every batch, no oneDNN copy (tests/test_gemv_kernel.py)
    assert f32.names["linear"] == "gemv-avx2" and f32.pack(torch.randn(96, 64)).onednn is None
    assert f32.names["norm"] == "c" and f32.names["argmax"] == "torch"  # fp32 logits: torch's
    assert f32.describe().startswith("kernels [avx2]: linear=gemv-avx2, ")


@pytest.mark.parametrize("options,linear", [
    (KernelOptions(panel_gemm=False), "onednn"),
    (KernelOptions(onednn=False), "panel-bf16"),
    (KernelOptions(onednn=False, panel_gemm=False), "torch"),
    (KernelOptions(c_kernels=False), "onednn"),  # the panel GEMM is one of the C kernels
])
@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_each_opt_out_moves_bf16_projections_to_the_next_choice(options, linear):
    k = select_kernels(torch.bfloat16, features=ZEN4, options=options)
    assert k.names["linear"] == linear
    assert (k.pack is None) == (linear == "torch")


def test_off_the_cpu_everything_is_pytorch():
    k = select_kernels(torch.bfloat16, device="meta", options=ALL_ON)
    assert k.pack is None and k.attention is A.attention_with_sdpa
    assert k.describe() == ("kernels [meta]: linear=torch, gate_up=torch+torch-silu, "
                            "attention=sdpa, norm=torch, rope=torch, kv_write=torch, argmax=torch, "
                            "state=torch")


def test_describe_names_every_operation():
    text = select_kernels(torch.float32).describe()
    assert text.startswith(f"kernels [{cpu_features().isa}]: ")
    for op in ("linear", "gate_up", "attention", "norm", "rope", "kv_write", "argmax", "state"):
        assert f"{op}=" in text


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_llama3(str(tmp_path_factory.mktemp("llama3")))


def _greedy(model, arch, prompts: dict[str, list[int]], steps: int):
    """Each prompt, then `steps` greedy tokens fed back: (tokens, every step's logits)."""
    driver = PagedDriver(model, arch, seed=5)
    out = driver.step(list(prompts.items()))
    tokens = {sid: [] for sid in prompts}
    logits = [out]
    for _ in range(steps):
        for sid, lg in out.items():
            tokens[sid] += model.kernels.argmax(lg[-1:])
        out = driver.step([(sid, t[-1:]) for sid, t in tokens.items()])
        logits.append(out)
    return tokens, logits


@pytest.mark.skipif(not BUILT, reason="no C compiler")
def test_no_kernels_gives_the_same_tokens(tiny_path, monkeypatch):
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = {"a": rng.integers(0, 320, 13).tolist(), "b": rng.integers(0, 320, 5).tolist()}
    fast, arch = load_model(tiny_path, torch.float32)
    assert fast.kernels.names["attention"].startswith("c-")
    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    monkeypatch.setenv("KVFLOW_NO_ONEDNN", "1")
    plain, _ = load_model(tiny_path, torch.float32)
    assert plain.kernels.names == {"linear": "torch", "gate_up": "torch+torch-silu", "attention": "sdpa",
                                   "norm": "torch", "rope": "torch", "kv_write": "torch",
                                   "argmax": "torch", "state": "torch"}
    assert plain.layers[0].packed == {} and plain.packed_lm_head is None
    want_tokens, want_logits = _greedy(plain, arch, prompts, steps=8)
    got_tokens, got_logits = _greedy(fast, arch, prompts, steps=8)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        for sid in prompts:
            torch.testing.assert_close(got[sid], want[sid], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_the_amx_choice_gives_the_same_greedy_tokens_as_the_panels(tiny_path):
    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    # a 37-token prompt runs through AMX (the tiles over the panels, or oneDNN where the CPU
    # has no AMX), decode rows the panels
    prompts = {"a": rng.integers(0, 320, 37).tolist(), "b": rng.integers(0, 320, 6).tolist()}
    panels, arch = load_model(tiny_path, torch.bfloat16,
                              kernels=select_kernels(torch.bfloat16, features=ZEN4, options=ALL_ON))
    amx, _ = load_model(tiny_path, torch.bfloat16,
                        kernels=select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=ALL_ON))
    assert amx.layers[0].packed["qkv_proj"].panel_rows == packed_linear.AMX_PANEL_ROWS
    assert (amx.layers[0].packed["qkv_proj"].onednn is None) == amx_panels_built()
    assert panels.layers[0].packed["qkv_proj"].panel_rows is None
    want_tokens, want_logits = _greedy(panels, arch, prompts, steps=6)
    got_tokens, got_logits = _greedy(amx, arch, prompts, steps=6)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        for sid in prompts:
            torch.testing.assert_close(got[sid].float(), want[sid].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not BUILT, reason="no C compiler")
@pytest.mark.slow
def test_the_start_up_line_names_the_kernels_and_both_choices_give_the_same_tokens(
        default_model_path, monkeypatch):
    from kvflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The capital of France is", "def fib(n):"]

    def run() -> tuple[str, list[list[int]]]:
        llm = LLM(default_model_path, dtype="float32", quantization="none", max_model_len=256, num_blocks=64)
        core = llm.engine.core
        outs = llm.generate(prompts, params, use_tqdm=False)
        return core.startup_report(), [o.outputs[0].token_ids for o in outs]

    fast_report, fast_tokens = run()
    monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    plain_report, plain_tokens = run()
    assert "attention=c-decode" in fast_report and "norm=c," in fast_report
    assert "attention=sdpa" in plain_report and "norm=torch," in plain_report
    assert plain_tokens == fast_tokens


@pytest.mark.skipif(not PANELS_BUILT, reason="the panel GEMM needs AVX512-BF16")
def test_amx_tiles_over_the_panels_give_the_panel_gemm_result():
    if not amx_panels_built():  # no AMX here: oneDNN's copy serves long batches instead
        k = select_kernels(torch.bfloat16, features=SAPPHIRE_RAPIDS, options=ALL_ON)
        assert k.pack(torch.randn(64, 64).bfloat16()).onednn is not None
        return
    torch.manual_seed(0)
    # rows: under a tile, whole tiles, a tail; N: a partial panel; K: one and several tiles
    for m, k, n, gate_up in ((5, 32, 200, False), (16, 64, 64, False), (37, 576, 960, False),
                             (40, 256, 256, True), (1, 96, 130, False)):
        w = (torch.randn(n, k) * 0.1).bfloat16()
        x = torch.randn(m, k).bfloat16()
        bias = None if gate_up else torch.randn(n).bfloat16()
        panels = pack_panels(w, gate_up=gate_up)
        want = panel_gemm(x, panels, n, bias, silu_mul=gate_up).float()
        for threads in (1, 2):
            got = amx_panel_gemm(x, panels, n, bias, threads, silu_mul=gate_up).float()
            # the same bf16 rounding, the fp32 sums in another order: at most one bf16 step
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-2, rtol=2 ** -7)
