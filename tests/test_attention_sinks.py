"""Attention sinks (gpt-oss: one learned logit per query head that joins every softmax's
denominator as a key whose value is zero) on every attention path, against a PyTorch reference
of the formula in fp64 (itself checked once against transformers' gpt-oss eager attention):
the C decode rows (fp32 and bf16 caches, the one-byte caches on each path this build has), the
C prompt kernel, prompt tokens as decode rows (in tiles and one by one), the PyTorch path, the
shared Attention layer; for GQA (8 query heads over 2 kv heads, head_dim 64), prompts with and
without earlier context, a sliding window, one and two threads. The same C checks rerun under
the AVX2 kind (KVFLOW_CPU_ISA=avx2, in a fresh process), a build without vector code runs the
scalar rows, and the Triton kernels run in Triton's interpreter (triton_sink_checks.py)."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow import attention as A
from kvflow.attention.kv_layout import FP8, UNIT_KV_SCALES, cache_shape
from kvflow.csrc import _SIGNATURES, library
from kvflow.model.cpu_features import cpu_features
from triton_reference import filled_cache, reference_attention, scattered_tables

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, DIM, BS = 8, 2, 64, 16
SCALE = DIM ** -0.5
ONE_BYTE = [FP8, torch.int8]
# decode rows: a first token, a partial block, whole blocks and a partial one, a long row
DECODE_LENS = [1, 17, 40, 70]
# a whole prompt, a chunk after context, a decode beside them, a long chunk past a window
PROMPT_LENS, PROMPT_QUERIES = [23, 40, 9, 70], [23, 7, 1, 33]


def sinks_for(seed: int = 0, heads: int = HEADS) -> torch.Tensor:
    """Logits of the scores' size (q.k * scale ~ N(0, 1) here): each head's sink takes a real
    share of its softmax."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(100 + seed)) * 2


def case(seq_lens, query_lens, cache_dtype, window=None, seed=0, heads=HEADS, kv_heads=KV_HEADS,
         dim=DIM, q_dtype=torch.float32):
    """(q, k_cache, v_cache, tables, meta) with every position's K/V already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 2
    tables = scattered_tables(seq_lens, BS, num_blocks, gen)
    k_cache, v_cache = filled_cache(seq_lens, tables, kv_heads, dim, BS, num_blocks, cache_dtype, gen)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(q_dtype)
    meta = A.build_attention_metadata(np.array(query_lens), np.array(seq_lens),
                                      [tables[i, :-(-n // BS)].tolist() for i, n in enumerate(seq_lens)],
                                      BS, sliding_window=window)
    return q, k_cache, v_cache, tables, meta


def reference(q, k_cache, v_cache, tables, seq_lens, query_lens, window, sinks, scale=SCALE):
    return reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window,
                               sinks=sinks).float()


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.float().reshape(want.shape), want, atol=tol, rtol=tol)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_reference_is_transformers_gpt_oss_eager_attention():
    """The formula as transformers computes it (the sinks a column of the logits, a softmax, the
    column dropped): the reference and the PyTorch path agree with it."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n = 21
    q, k_cache, v_cache, tables, meta = case([n], [n], torch.float32, seed=1)
    sinks = sinks_for(1)
    k, v = A.kv_layout.read_rows(k_cache, v_cache, meta.slot_mapping)  # [n, kvh, D]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    hf, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                    v.transpose(0, 1)[None], causal, SCALE)
    close(reference(q, k_cache, v_cache, tables, [n], [n], None, sinks), hf[0], 1e-5)
    close(A.attention_with_sdpa(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=sinks), hf[0], 1e-5)


# -- the C decode kernel ------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_c_decode_rows(cache_dtype, q_dtype, window, threads):
    q, k_cache, v_cache, tables, meta = case(DECODE_LENS, [1] * 4, cache_dtype, window, seed=2,
                                             q_dtype=q_dtype)
    sinks = sinks_for(2)
    got = A.attention_with_kernels(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=sinks)
    want = reference(q, k_cache, v_cache, tables, DECODE_LENS, [1] * 4, window, sinks)
    # bf16 q (the AVX512-BF16 row): probabilities enter the value sums in bf16, out rounded
    close(got, want, 1e-2 if q_dtype == torch.bfloat16 else 3e-5)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv_dtype", ONE_BYTE, ids=["fp8", "int8"])
def test_c_decode_rows_of_one_byte_caches_on_every_built_path(kv_dtype, window):
    q, k_cache, v_cache, tables, meta = case(DECODE_LENS, [1] * 4, kv_dtype, window, seed=3)
    sinks = sinks_for(3)
    want = reference(q, k_cache, v_cache, tables, DECODE_LENS, [1] * 4, window, sinks)
    for isa in A.q8_isas():
        got = torch.full(q.shape, float("nan"))
        assert A.decode_with_kernel(q, k_cache, v_cache, meta, SCALE, got, q8_isa=isa, sinks=sinks)
        # fp8's AVX512-BF16 row rounds q and the weights to bf16
        close(got, want, 1e-2 if isa == "avx512-bf16" else 1e-4)


@pytest.mark.parametrize("dim,kv_heads", [(40, 2), (64, 1)])  # the scalar row; 8 heads a kv head
def test_c_decode_rows_of_other_shapes(dim, kv_heads):
    q, k_cache, v_cache, tables, meta = case(DECODE_LENS, [1] * 4, torch.float32, seed=4,
                                             kv_heads=kv_heads, dim=dim)
    sinks = sinks_for(4)
    got = torch.empty(q.shape)
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, dim ** -0.5, got, sinks=sinks)
    close(got, reference(q, k_cache, v_cache, tables, DECODE_LENS, [1] * 4, None, sinks,
                         scale=dim ** -0.5), 3e-5)


# -- prompts: the prompt kernel, or prompt tokens as decode rows --------------------------

PROMPT_PATHS = {"kernel": dict(prompt_kernel=True), "rows": dict(prompt_kernel=False),
                "rows-untiled": dict(prompt_kernel=False, prompt_tiles=False)}


def prompt_kernel_serves(cache_dtype) -> bool:
    return (cache_dtype in (torch.bfloat16, *ONE_BYTE) and cpu_features().avx512_bf16
            and bool(library().paged_prefill_bf16_supported(HEADS, KV_HEADS, DIM, BS)))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("path", list(PROMPT_PATHS))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, *ONE_BYTE],
                         ids=["f32", "bf16", "fp8", "int8"])
def test_c_prompt_chunks(cache_dtype, path, window, threads):
    """Prompts with and without earlier context and a decode in one step."""
    if path == "kernel" and not prompt_kernel_serves(cache_dtype):
        pytest.skip("no prompt kernel for this cache here (it needs AVX512-BF16)")
    q, k_cache, v_cache, tables, meta = case(PROMPT_LENS, PROMPT_QUERIES, cache_dtype, window, seed=5)
    sinks = sinks_for(5)
    q8 = A.best_q8_isa(cpu_features(), cache_dtype) if cache_dtype in ONE_BYTE else None
    got = A.CAttention(cache_dtype, q8_isa=q8, **PROMPT_PATHS[path])(
        q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=sinks)
    want = reference(q, k_cache, v_cache, tables, PROMPT_LENS, PROMPT_QUERIES, window, sinks)
    # the prompt kernel reads q in bf16 and weighs values in bf16; fp8's bf16 decode row too
    bf16_math = path == "kernel" or q8 == "avx512-bf16"
    close(got, want, 1e-2 if bf16_math else 1e-4)


@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_c_prompt_kernel_entry_point(amx):
    """prefill_with_kernel (the benchmarks' and tests' way in, AMX where granted) takes them."""
    if not prompt_kernel_serves(torch.bfloat16) or (amx and not library().prefill_amx_available()):
        pytest.skip("no prompt kernel (or no AMX) here")
    q, k_cache, v_cache, tables, meta = case(PROMPT_LENS, PROMPT_QUERIES, torch.bfloat16, seed=6)
    sinks = sinks_for(6)
    got = torch.full(q.shape, float("nan"))
    assert A.prefill_with_kernel(q, k_cache, v_cache, meta, SCALE, got, amx=amx, sinks=sinks)
    want = reference(q, k_cache, v_cache, tables, PROMPT_LENS, PROMPT_QUERIES, None, sinks)
    prompt_rows = np.concatenate([np.arange(s, s + n) for s, n in zip(*meta.prefill_arrays()[:2])])
    close(got[prompt_rows], want[prompt_rows], 1e-2)


# -- the PyTorch path --------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (FP8, torch.float32)], ids=["f32", "bf16", "fp8"])
def test_torch_path(cache_dtype, q_dtype, window):
    q, k_cache, v_cache, tables, meta = case(PROMPT_LENS, PROMPT_QUERIES, cache_dtype, window,
                                             seed=7, q_dtype=q_dtype)
    sinks = sinks_for(7)
    got = A.attention_with_sdpa(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=sinks)
    want = reference(q, k_cache, v_cache, tables, PROMPT_LENS, PROMPT_QUERIES, window, sinks)
    close(got, want, 1e-2 if q_dtype == torch.bfloat16 else 1e-5)
    # its decode rows through a decode kernel where one is given, as the C backend passes it
    q8 = A.best_q8_isa(cpu_features(), cache_dtype) if cache_dtype in ONE_BYTE else None
    got = A.attention_with_sdpa(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=sinks,
                                decode_kernel=partial(A.decode_with_kernel, q8_isa=q8))
    close(got, want, 1e-2 if q_dtype == torch.bfloat16 or cache_dtype == FP8 else 3e-5)


# -- the limits: a sink of -inf is no sink, a huge one takes all the weight --------------

C_PATHS = {"decode": (torch.float32, {}), "decode-bf16": (torch.bfloat16, {}),
           "rows": (torch.float32, dict(prompt_kernel=False)), "kernel": (torch.bfloat16, {}),
           "int8": (torch.int8, {}), "fp8": (FP8, {})}


@pytest.mark.parametrize("path", list(C_PATHS))
def test_c_paths_without_effective_sinks_give_their_numbers_bit_for_bit(path):
    """A sink of -1e30 adds exp(-1e30 - max) = 0 to every sum: the same bits as no sinks."""
    cache_dtype, choices = C_PATHS[path]
    lens, queries = (DECODE_LENS, [1] * 4) if path.startswith("decode") else (PROMPT_LENS, PROMPT_QUERIES)
    q, k_cache, v_cache, _, meta = case(lens, queries, cache_dtype, 16, seed=8)
    q8 = A.best_q8_isa(cpu_features(), cache_dtype) if cache_dtype in ONE_BYTE else None
    attend = A.CAttention(cache_dtype, q8_isa=q8, **choices)
    plain = attend(q, k_cache, v_cache, meta, SCALE, KV_HEADS)
    got = attend(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=torch.full((HEADS,), -1e30))
    assert torch.equal(got, plain)


@pytest.mark.parametrize("path", list(C_PATHS) + ["torch"])
def test_a_huge_sink_takes_all_the_weight(path):
    cache_dtype, choices = C_PATHS.get(path, (torch.float32, None))
    q, k_cache, v_cache, _, meta = case(PROMPT_LENS, PROMPT_QUERIES, cache_dtype, seed=9)
    q8 = A.best_q8_isa(cpu_features(), cache_dtype) if cache_dtype in ONE_BYTE else None
    attend = (A.attention_with_sdpa if choices is None
              else A.CAttention(cache_dtype, q8_isa=q8, **choices))
    for sink in (40.0, 1e30):  # a share of e^-35 and less; an exp that overflows
        got = attend(q, k_cache, v_cache, meta, SCALE, KV_HEADS, sinks=torch.full((HEADS,), sink))
        assert got.isfinite().all() and got.abs().max() < 1e-9


def test_torch_path_with_a_sink_of_minus_inf_is_sdpa():
    q, k_cache, v_cache, _, meta = case(PROMPT_LENS, PROMPT_QUERIES, torch.float32, 16, seed=10)
    plain = A.attention_with_sdpa(q, k_cache, v_cache, meta, SCALE, KV_HEADS)
    got = A.attention_with_sdpa(q, k_cache, v_cache, meta, SCALE, KV_HEADS,
                                sinks=torch.full((HEADS,), -1e30))
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-5)


# -- the shared layer -------------------------------------------------------------------

@pytest.mark.parametrize("c_kernels", [True, False], ids=["c", "torch"])
def test_attention_layer_passes_its_sinks(c_kernels):
    from kvflow.layers.attention import Attention
    from kvflow.model.kernels import KernelOptions, select_kernels

    kernels = select_kernels(torch.float32, options=KernelOptions(c_kernels=c_kernels))
    layer = Attention(HEADS, KV_HEADS, DIM, SCALE, sliding_window=16)
    assert layer.sinks is None
    q, k_cache, v_cache, tables, meta = case(PROMPT_LENS, PROMPT_QUERIES, torch.float32, 16, seed=11)
    # this step's K/V come in with q and are written by the layer: cached context is kept
    k, v = A.kv_layout.read_rows(k_cache, v_cache, meta.slot_mapping)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    layer.sinks = sinks_for(11)
    got = layer(qkv.clone(), (k_cache, v_cache), meta, kernels)
    want = reference(q, k_cache, v_cache, tables, PROMPT_LENS, PROMPT_QUERIES, 16, layer.sinks)
    close(got, want, 1e-4)


# -- the scalar build, the AVX2 kind, Triton ---------------------------------------------

@pytest.fixture(scope="module")
def scalar_lib(tmp_path_factory):
    """The decode kernels built with no vector extension (x86-64 baseline): every row scalar."""
    csrc = Path(A.__file__).resolve().parent.parent / "csrc"
    out = str(tmp_path_factory.mktemp("scalar") / "paged_attention_scalar.so")
    subprocess.run(["cc", "-O2", "-march=x86-64", "-fno-math-errno", "-shared", "-fPIC", "-std=c11",
                    str(csrc / "paged_attention.c"), str(csrc / "paged_attention_quant.c"),
                    "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(out)
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = None, _SIGNATURES[name]
    lib.paged_decode_q8.restype = None
    lib.paged_decode_q8.argtypes = _SIGNATURES["paged_decode_f32"] + [ctypes.c_int64] * 4
    lib.paged_decode_q8_isas.restype = ctypes.c_int64
    assert lib.paged_decode_q8_isas() == 1  # the scalar path only
    return lib


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, *ONE_BYTE],
                         ids=["f32", "bf16", "fp8", "int8"])
def test_scalar_build(scalar_lib, cache_dtype, window):
    q, k_cache, v_cache, tables, meta = case(DECODE_LENS, [1] * 4, cache_dtype, window, seed=12)
    sinks = sinks_for(12)
    out = torch.full(q.shape, float("nan"))
    bt, lens, rows = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_rows
    words = [q.data_ptr(), HEADS * DIM, k_cache.data_ptr(), v_cache.data_ptr(), bt.ctypes.data,
             bt.shape[1], lens.ctypes.data, rows.ctypes.data, 0, len(rows), HEADS, KV_HEADS, DIM, BS,
             SCALE, out.data_ptr(), HEADS * DIM, 0, window or 0, sinks.data_ptr()]
    if cache_dtype in ONE_BYTE:
        one = int(np.array(1.0, dtype=np.float32).view(np.uint32))
        scalar_lib.paged_decode_q8(*words, A.Q8_KINDS[cache_dtype], 0, one, one)
    else:
        getattr(scalar_lib, "paged_decode_bf16" if cache_dtype == torch.bfloat16
                else "paged_decode_f32")(*words)
    close(out, reference(q, k_cache, v_cache, tables, DECODE_LENS, [1] * 4, window, sinks), 1e-4)


def test_cpu_kind_under_test():
    """Under KVFLOW_CPU_ISA (test_avx2_kind's fresh process) the kernels are that kind's."""
    cap = os.environ.get("KVFLOW_CPU_ISA")
    if cap:
        assert cpu_features().isa == cap
        assert not cpu_features().avx512_bf16 and A.q8_isas() == ("scalar", "avx2")


def _run_in_fresh_process(env: dict, args: list[str]) -> str:
    env = {**env, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.skipif(bool(os.environ.get("KVFLOW_CPU_ISA")), reason="already under a capped kind")
def test_avx2_kind():
    """The C checks above again with the kernels built for the AVX2 kind (the AVX2 rows, the
    prompt tiles; no prompt kernel, so prompts run as rows). Builds the library once (~15 s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env["KVFLOW_CPU_ISA"] = "avx2"
    out = _run_in_fresh_process(env, [str(HERE / "test_attention_sinks.py"), "-k",
                                      "c_ or cpu_kind or huge_sink or bit_for_bit or layer"])
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 50, out[-2000:]


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNEL_CHECKS_DEVICE": "cpu"}
    out = _run_in_fresh_process(env, [str(HERE / "triton_sink_checks.py")])
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 6, out[-2000:]
