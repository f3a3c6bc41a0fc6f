"""A decode step's decoder layers in one C call (kvflow/model/decode_graph.py) give the per-layer
path's numbers bit for bit, for every quantized format, both activation dtypes, several rows,
sliding windows and both instruction sets, over decode steps that cross block boundaries, and
for fp32 models on the fp32 GEMV (fp32, bf16 and fp16 panels, both its vector paths) and bf16
ones on the bf16 panel GEMM, over float and one-byte (fp8, int8) KV caches, the latter on each
path of their decode kernel; and the steps and models it does not take run layer by layer."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from kvflow.csrc import library
from kvflow.model.arch import LlamaArchConfig
from kvflow.csrc.gemm import panel_gemm_built
from kvflow.csrc.gemv import GEMV_MAX_ROWS, gemv_isas
from kvflow import attention as A
from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.model.decode_graph import MAX_ROWS, DecodeGraph, why_not
from kvflow.model.kernels import KernelOptions, select_kernels
from kvflow.model.key_scales import apply_key_scales
from kvflow.attention.kv_layout import FP8
from kvflow.models.llama import LlamaForCausalLM
from kvflow.model.packed_linear import AMX_PANEL_ROWS, PackedWeight
from kvflow.checkpoint.gguf_blocks import decode
from kvflow.model.quant.int8 import quantize_int8
from kvflow.model.quant.packing import pack
from kvflow.model.quant.qlinear import QuantizedWeight, available_isas

# head_dim 64 as the default model's (the decode kernel's vector rows), GQA 4/2, q_size != hidden
ARCH = LlamaArchConfig(
    architecture="LlamaForCausalLM", vocab_size=96, hidden_size=128, intermediate_size=192,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
    tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_id=None)
FORMATS = ("Q4_1", "Q4_0", "Q8_0", "int8")
ISAS = [isa for isa in available_isas() if isa != "scalar"] or ["scalar"]
# the fp32 GEMV's vector paths this build and CPU have ("gemv-<isa>" models below)
GEMV_PATHS = [isa for isa in ("avx2", "avx512") if isa in gemv_isas()
              and (isa == "avx2" or cpu_features().avx512)]
GEMV_STORAGE = {"": None, "-bf16": torch.bfloat16, "-fp16": torch.float16}
BLOCK = 4
# one-byte caches' decode paths this build and CPU run (their vector rows want 16-token blocks)
Q8_PATHS = [isa for isa in A.q8_isas() if isa == "scalar" or A.best_q8_isa(cpu_features()) in
            (isa, "avx512")]
Q8_BLOCK = 16
torch.set_num_threads(1)  # one test below splits over two


def _quantized(w: torch.Tensor, fmt: str, isa: str) -> QuantizedWeight:
    if fmt == "int8":
        return quantize_int8(w, isa)
    n, k = w.shape
    raw = quantize(w.float().numpy(), GGMLQuantizationType[fmt])
    kind, q, d, m = decode(raw, fmt, n, k)
    return QuantizedWeight(kind=kind, n=n, k=k, packed=pack(kind, q, d, m), isa=isa, source=fmt)


def tiny_model(fmt: str, dtype: torch.dtype, isa: str, arch: LlamaArchConfig = ARCH,
               seed: int = 0) -> LlamaForCausalLM:
    """A random Llama whose projections are quantized to `fmt` (the LM head stays float); fmt
    "gemv", "gemv-bf16" or "gemv-fp16": an fp32 one on the fp32 GEMV's `isa` path, its panels
    stored in fp32, bf16 or fp16 (the `weight_dtype` option); "panels": a bf16 one on the bf16
    panel GEMM alone (as on a CPU without AMX, whatever this one has); "panels-amx": the panels
    for few rows, AMX for more (as on a CPU with AMX)."""
    torch.manual_seed(seed)
    kernels = None
    if fmt == "panels":
        kernels = select_kernels(dtype, features=CpuFeatures(cpu_features().flags - {"amx_bf16", "amx_tile"}),
                                 options=KernelOptions(onednn=False))
    elif fmt == "panels-amx":
        kernels = select_kernels(dtype, features=CpuFeatures(cpu_features().flags | {"amx_bf16", "amx_tile"}))
    elif fmt.startswith("gemv"):
        kernels = select_kernels(dtype, options=KernelOptions(
            gemv_isa=isa if isa == "avx2" else None, gemv_dtype=GEMV_STORAGE[fmt[4:]]))
    model = LlamaForCausalLM(arch, dtype, kernels=kernels).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32) if "norm" in name or "layernorm" in name
                    else 0.05 * torch.randn_like(p, dtype=torch.float32))
    model.pack_weights()
    if kernels is not None:
        packed = model.layers[0].packed["qkv_proj"]
        assert packed.panels is not None if fmt.startswith("panels") else packed.gemv_isa == isa
        return model
    dense = model.state_dict()  # (a packed weight was released: this gives it back from its panels)
    for i, layer in enumerate(model.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            layer.packed[name] = PackedWeight(quant=_quantized(dense[f"layers.{i}.{name}"], fmt, isa))
    return model


class Driver:
    """Steps a model over its own paged cache (shuffled blocks, one table per sequence), with
    one metadata for all layers or, with `windows`, one per layer (a window per layer)."""

    def __init__(self, model, kv_dtype=None, windows=None, num_blocks: int = 192, seed: int = 0,
                 as_decodes: bool = False, block_size: int = BLOCK):
        self.model, self.windows, self.as_decodes = model, windows, as_decodes
        self.block = block_size
        self.kv_caches = allocate_kv_caches(model.arch, num_blocks, block_size, kv_dtype or model.dtype)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, plan: list[tuple[int, list[int]]]) -> torch.Tensor:
        """plan: (sequence, its new tokens) -> final-normed hidden states [T, hidden]."""
        qlens, slens, tables, ids = [], [], [], []
        for sid, tokens in plan:
            end = self.lens.get(sid, 0) + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block < end:
                table.append(self.free.pop())
            qlens.append(len(tokens))
            slens.append(end)
            tables.append(list(table))
            ids += tokens
            self.lens[sid] = end
        # a step where every sequence has prior context: as the runner builds a verification step
        as_decodes = self.as_decodes and all(s > q for s, q in zip(slens, qlens))
        if self.windows is None:
            meta = build_attention_metadata(np.array(qlens), np.array(slens), tables, self.block,
                                            queries_as_decodes=as_decodes)
        else:
            by_window = {w: build_attention_metadata(np.array(qlens), np.array(slens), tables, self.block,
                                                     sliding_window=w, queries_as_decodes=as_decodes)
                         for w in set(self.windows)}
            meta = [by_window[w] for w in self.windows]
        first = meta if self.windows is None else meta[0]
        with torch.no_grad():
            return self.model(torch.tensor(ids), torch.from_numpy(first.positions), self.kv_caches, meta)


def count_graph_steps(model) -> list:
    """Build the model's graph now and record what each of its `run` calls returned."""
    graph = DecodeGraph.build(model)
    assert graph is not None, why_not(model)
    model._decode_graph = (model.kernels, graph)
    taken = []
    run = graph.run

    def counting(*args):
        out = run(*args)
        taken.append(out is not None)
        return out
    graph.run = counting
    return taken


def layer_by_layer(model) -> None:
    model._decode_graph = (model.kernels, None)


def on_one_byte_cache(model, kv_dtype, q8_isa: str) -> None:
    """The model's kernels for a one-byte cache, its decode kernel on the `q8_isa` path (as
    kernels.select_kernels picks one per CPU)."""
    k = model.kernels.with_kv_dtype(kv_dtype)
    model.kernels = dataclasses.replace(k, attention=dataclasses.replace(k.attention, q8_isa=q8_isa))


def run_both(fmt, dtype, isa, rows, decode_steps=9, kv_dtype=None, windows=None, arch=ARCH,
             q8_isa=None, key_scales=None):
    """The same schedule on two copies of one model, one with the graph: prompts of different
    lengths in one step, then `decode_steps` decode-only steps of `rows` rows (context growing
    across 4-token blocks; 16-token ones with `q8_isa`, a one-byte cache's decode path; both
    copies with `key_scales`, an fp8 cache's, model/key_scales.py, where given).
    Returns (hidden states with, without, which steps the graph took)."""
    with_graph, without = tiny_model(fmt, dtype, isa, arch), tiny_model(fmt, dtype, isa, arch)
    for m in (with_graph, without):
        if kv_dtype is not None:  # as the runner chooses them for its cache
            m.kernels = m.kernels.with_kv_dtype(kv_dtype)
        if q8_isa is not None:
            on_one_byte_cache(m, kv_dtype, q8_isa)
        if key_scales is not None:
            apply_key_scales(m, key_scales)
    taken = count_graph_steps(with_graph)
    layer_by_layer(without)
    rng = np.random.default_rng(1)
    # lengths 2, 5, 8, ... (again from 2 past 64 rows: the longest stays within ARCH's positions)
    prompts = [rng.integers(0, ARCH.vocab_size, 2 + 3 * (i % 64)).tolist() for i in range(rows)]
    block = BLOCK if q8_isa is None else Q8_BLOCK
    need = sum(-(-(len(p) + decode_steps) // block) for p in prompts) + 8
    drivers = [Driver(m, kv_dtype, windows, num_blocks=max(192, need), block_size=block)
               for m in (with_graph, without)]
    outs = [[], []]
    last = [p[-1] for p in prompts]
    plans = [[(i, p) for i, p in enumerate(prompts)]]
    for s in range(decode_steps):
        plans.append([(i, [(t * 7 + s) % ARCH.vocab_size]) for i, t in enumerate(last)])
    for plan in plans:
        for d, out in zip(drivers, outs):
            out.append(d.step(plan))
    return outs[0], outs[1], taken


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_one_call_step_gives_the_per_layer_numbers(fmt, dtype, rows):
    got, want, taken = run_both(fmt, dtype, ISAS[-1], rows)
    assert taken == [True] * 9  # every decode step (the prompt step never asks)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and torch.equal(g, w), (fmt, dtype, rows, step)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_isa_of_this_build(fmt, isa):
    """The quantized GEMM's narrower path of this build (AVX2 beside AVX-512 VNNI)."""
    got, want, taken = run_both(fmt, torch.bfloat16, isa, 3, decode_steps=5)
    assert taken == [True] * 5
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_rows_split_over_two_threads():
    """The kernels split over the pool from inside the one call (attention by key count,
    projections by panels), as they do from Python."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want, taken = run_both("Q4_1", torch.bfloat16, ISAS[-1], 8, decode_steps=4)
    finally:
        torch.set_num_threads(old)
    assert taken == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_max_rows_of_int8():
    """At MAX_ROWS rows, int8 W8A8 with bf16 activations (per-row scales over every row of the
    step); the one call passes each projection's widening threshold (qlinear.widen_from) as
    the per-layer path does."""
    got, want, taken = run_both("int8", torch.bfloat16, ISAS[-1], MAX_ROWS, decode_steps=3)
    assert taken == [True] * 3
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_fp32_activations_into_a_bf16_cache_and_a_bias():
    """fp32 activations written into a bf16 KV cache (rounded by the C writer), and Qwen2's
    qkv bias."""
    arch = dataclasses.replace(ARCH, attention_bias=True)
    got, want, taken = run_both("Q4_1", torch.float32, ISAS[-1], 3, kv_dtype=torch.bfloat16, arch=arch)
    assert taken and all(taken)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("q8_isa", Q8_PATHS)
@pytest.mark.parametrize("kv_dtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("fmt,dtype", [("Q4_1", torch.bfloat16), ("Q8_0", torch.float32),
                                       *[("gemv", torch.float32)] * bool(GEMV_PATHS)])
def test_one_byte_caches_give_the_per_layer_numbers(fmt, dtype, kv_dtype, q8_isa):
    """fp8 and int8 caches: this step's K/V quantized by write_kv_q8 and read by
    paged_decode_q8 on the path the per-layer path takes (each this CPU runs), from the one
    call, over 16-token blocks that the decode steps cross."""
    isa = GEMV_PATHS[0] if fmt == "gemv" else ISAS[-1]
    assert library().paged_decode_q8_serves(A.Q8_ISAS[q8_isa], ARCH.head_dim, Q8_BLOCK)
    got, want, taken = run_both(fmt, dtype, isa, 3, decode_steps=12, kv_dtype=kv_dtype,
                                q8_isa=q8_isa)
    assert taken == [True] * 12
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and torch.equal(g, w), (fmt, kv_dtype, q8_isa, step)


def test_max_rows_of_an_fp8_cache_over_two_threads():
    """At MAX_ROWS rows the one-byte decode kernel's rows split by key count over the pool
    from inside the one call, as from Python."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want, taken = run_both("Q4_1", torch.bfloat16, ISAS[-1], MAX_ROWS, decode_steps=4,
                                    kv_dtype=FP8, q8_isa=Q8_PATHS[-1])
    finally:
        torch.set_num_threads(old)
    assert taken == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_sliding_windows_one_per_layer():
    """Layers with different windows (one metadata each: a hybrid model's KV cache groups), and
    windows shorter than the context, over 14 decode steps."""
    got, want, taken = run_both("Q4_0", torch.bfloat16, ISAS[-1], 3, decode_steps=14,
                                windows=[6, None, 6])
    assert taken and all(taken)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    got, want, taken = run_both("Q8_0", torch.float32, ISAS[-1], 2, decode_steps=14, windows=[5, 5, 5])
    assert taken and all(taken)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_mixed_and_wide_steps_run_layer_by_layer():
    model = tiny_model("Q4_1", torch.bfloat16, ISAS[-1])
    taken = count_graph_steps(model)
    d = Driver(model, num_blocks=MAX_ROWS + 8)  # a block per sequence
    d.step([(i, [1, 2]) for i in range(MAX_ROWS + 1)])  # prompts
    d.step([(i, [3]) for i in range(MAX_ROWS + 1)])  # decode-only, but more rows than MAX_ROWS
    d.step([(0, [4]), (MAX_ROWS + 2, [5, 6, 7])])  # a decode beside a prompt
    d.step([(0, [5]), (1, [5])])
    assert taken == [False, True]  # asked only at the decode-only steps


def run_verify(fmt, dtype, isa, seqs, k, steps=4, windows=None):
    """Speculative verification steps: prompts, then `steps` steps where each of `seqs`
    sequences brings its known token and k drafts (1 + k query tokens over its context), as
    decode rows (queries_as_decodes) on two copies of one model, one with the graph; and the
    same schedule layer by layer with ordinary (prompt-row) metadata."""
    models = [tiny_model(fmt, dtype, isa) for _ in range(3)]
    taken = count_graph_steps(models[0])
    for m in models[1:]:
        layer_by_layer(m)
    drivers = [Driver(models[0], windows=windows, as_decodes=True),
               Driver(models[1], windows=windows, as_decodes=True), Driver(models[2], windows=windows)]
    rng = np.random.default_rng(2)
    plans = [[(i, rng.integers(0, ARCH.vocab_size, 3 + 5 * i).tolist()) for i in range(seqs)]]
    plans += [[(i, rng.integers(0, ARCH.vocab_size, 1 + k).tolist()) for i in range(seqs)]
              for _ in range(steps)]
    outs = [[d.step(plan) for plan in plans] for d in drivers]
    return outs, taken


def gemv_graph_rows(isa: str) -> int:
    """The most rows of a step the graph takes on this GEMV path."""
    return min(GEMV_MAX_ROWS[isa], MAX_ROWS)


VERIFY_CASES = [("Q4_1", torch.bfloat16, ISAS[-1], 1, 4), ("Q4_1", torch.bfloat16, ISAS[-1], 3, 4),
                ("Q8_0", torch.float32, ISAS[-1], 2, 3), ("panels", torch.bfloat16, ISAS[-1], 2, 4)]
# up to 64 rows (AVX2's GEMV takes any): 4 steps of 1 + k tokens stay within ARCH's positions
VERIFY_CASES += [("gemv" + st, torch.float32, isa, 1, min(gemv_graph_rows(isa), 64) - 1)
                 for isa in GEMV_PATHS for st in ("", "-bf16")]


@pytest.mark.parametrize("fmt,dtype,isa,seqs,k", VERIFY_CASES)
def test_verification_steps_take_the_one_call_step(fmt, dtype, isa, seqs, k):
    """A step that checks drafts (each sequence 1 + k tokens) has every token as a decode row:
    the graph takes it with the per-layer path's numbers bit for bit; those equal the prompt-row
    path's in fp32 (the same decode kernel serves both there) and are close in bf16 (the prompt
    kernel sums in another order)."""
    if fmt == "panels" and not panel_gemm_built():
        pytest.skip("the bf16 panel GEMM is not built here")
    (graph, layers, prompt_rows), taken = run_verify(fmt, dtype, isa, seqs, k)
    assert taken == [True] * 4
    for g, w, p in zip(graph, layers, prompt_rows):
        assert torch.equal(g, w)
        if dtype == torch.float32:
            assert torch.equal(w, p)
        else:
            torch.testing.assert_close(w.float(), p.float(), atol=0.05, rtol=0.05)


def test_verification_steps_with_sliding_windows():
    (graph, layers, prompt_rows), taken = run_verify("Q4_0", torch.float32, ISAS[-1], 2, 3,
                                                     steps=6, windows=[6, None, 6])
    assert taken == [True] * 6
    assert all(torch.equal(g, w) and torch.equal(w, p)
               for g, w, p in zip(graph, layers, prompt_rows))


def test_models_the_graph_does_not_take():
    assert why_not(tiny_model("Q4_1", torch.bfloat16, ISAS[-1])) is None
    qk = tiny_model("Q4_1", torch.bfloat16, ISAS[-1], dataclasses.replace(ARCH, qk_norm=True))
    assert "QK-norm" in why_not(qk)
    sinks = tiny_model("Q4_1", torch.bfloat16, ISAS[-1])  # decode_step.c takes no sinks
    sinks.layers[-1].attn.sinks = torch.zeros(sinks.layers[-1].attn.num_heads)
    assert "attention sinks" in why_not(sinks)
    moe = dataclasses.replace(ARCH, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    model = LlamaForCausalLM(moe, torch.float32)
    model.pack_weights()
    assert "experts" in why_not(model)
    # fp32 weights where no GEMV serves, bf16 ones where no panel GEMM does (oneDNN, from Python)
    for dtype, options in ((torch.float32, KernelOptions(gemv=False)),
                           (torch.bfloat16, KernelOptions(panel_gemm=False))):
        float_model = LlamaForCausalLM(ARCH, dtype, kernels=select_kernels(dtype, options=options))
        float_model.pack_weights()
        assert "neither quantized nor on the fp32 GEMV or the bf16 panels" in why_not(float_model)
    # bf16 activations with an fp32 cache: the C writer does not take it
    model = tiny_model("Q4_1", torch.bfloat16, ISAS[-1])
    model.kernels = model.kernels.with_kv_dtype(torch.float32)
    taken = count_graph_steps(model)
    d = Driver(model, kv_dtype=torch.float32)
    d.step([(0, [1, 2])])
    d.step([(0, [3])])
    assert taken == [False]


@pytest.mark.skipif(not GEMV_PATHS, reason="no vector fp32 GEMV on this CPU")
@pytest.mark.parametrize("isa", GEMV_PATHS)
@pytest.mark.parametrize("storage", list(GEMV_STORAGE))
def test_fp32_gemv_steps_give_the_per_layer_numbers(isa, storage):
    """fp32 models whose projections the fp32 GEMV serves (fp32, bf16- or fp16-stored panels,
    the AVX-512 path and AVX2 forced): their norms, GEMVs and SiLU in the one call, the same
    numbers at 1, 3 and the most rows the graph takes on the GEMV."""
    for rows in sorted({1, 3, gemv_graph_rows(isa)}):
        got, want, taken = run_both("gemv" + storage, torch.float32, isa, rows, decode_steps=4)
        assert taken == [True] * 4, (isa, storage, rows)
        for step, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == torch.float32 and torch.equal(g, w), (isa, storage, rows, step)


@pytest.mark.skipif(not GEMV_PATHS, reason="no vector fp32 GEMV on this CPU")
@pytest.mark.parametrize("isa", GEMV_PATHS)
def test_fp32_gemv_steps_above_its_rows_run_layer_by_layer(isa):
    """Above GEMV_MAX_ROWS (AVX-512) oneDNN serves the projections, above MAX_ROWS (AVX2, whose
    GEMV serves every batch) the step is wide: the graph declines those steps (and the numbers
    are the per-layer path's, which alone ran)."""
    model = tiny_model("gemv-bf16", torch.float32, isa)
    assert DecodeGraph.build(model).max_rows == gemv_graph_rows(isa)
    got, want, taken = run_both("gemv-bf16", torch.float32, isa, gemv_graph_rows(isa) + 1,
                                decode_steps=2)
    assert taken == [False, False]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not GEMV_PATHS, reason="no vector fp32 GEMV on this CPU")
def test_fp32_gemv_with_a_bias_a_bf16_cache_and_two_threads():
    """Qwen2's qkv bias added by the GEMV, K/V rounded into a bf16 cache, the GEMV's panels and
    the attention split over two threads from inside the call."""
    arch = dataclasses.replace(ARCH, attention_bias=True)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want, taken = run_both("gemv-fp16", torch.float32, GEMV_PATHS[-1], 3, decode_steps=4,
                                    kv_dtype=torch.bfloat16, arch=arch)
    finally:
        torch.set_num_threads(old)
    assert taken == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not panel_gemm_built(), reason="no AVX512-BF16 panel GEMM here")
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_bf16_panel_steps_give_the_per_layer_numbers(rows):
    """bf16 models on the panel GEMM (gate_up with SiLU * up fused): the same numbers at 1, 3
    and MAX_ROWS rows."""
    got, want, taken = run_both("panels", torch.bfloat16, "avx512", rows, decode_steps=4)
    assert taken == [True] * 4
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not panel_gemm_built(), reason="no AVX512-BF16 panel GEMM here")
def test_bf16_panels_beside_onednn_amx_take_steps_up_to_the_panels_rows_only():
    """Where AMX serves longer batches (packed_linear.AMX_PANEL_ROWS), the graph takes decode
    steps the panels serve and leaves longer ones to the per-layer path (oneDNN)."""
    rows = AMX_PANEL_ROWS
    assert DecodeGraph.build(tiny_model("panels-amx", torch.bfloat16, "avx512")).max_rows == rows
    got, want, taken = run_both("panels-amx", torch.bfloat16, "avx512", rows, decode_steps=2)
    assert taken == [True, True] and all(torch.equal(g, w) for g, w in zip(got, want))
    got, want, taken = run_both("panels-amx", torch.bfloat16, "avx512", rows + 1, decode_steps=2)
    assert taken == [False, False] and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not panel_gemm_built(), reason="no AVX512-BF16 panel GEMM here")
def test_bf16_panels_unfused_gate_up_a_bias_and_two_threads():
    """An intermediate size whose gate and up do not come in whole panels (SiLU * up as its own
    kernel after the GEMM), Qwen2's bf16 qkv bias, the panels split over two threads."""
    arch = dataclasses.replace(ARCH, attention_bias=True, intermediate_size=176)
    assert not tiny_model("panels", torch.bfloat16, "avx512", arch).layers[0].packed["gate_up_proj"].gate_up
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want, taken = run_both("panels", torch.bfloat16, "avx512", 5, decode_steps=4, arch=arch)
    finally:
        torch.set_num_threads(old)
    assert taken == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("KVFLOW_NO_DECODE_GRAPH", "1")
    assert why_not(tiny_model("Q4_1", torch.bfloat16, ISAS[-1])) == "KVFLOW_NO_DECODE_GRAPH=1"


AVX2_CHECK = """
import json, sys
import kvflow.csrc as c
c._FLAGS = [f for f in c._FLAGS if f != "-march=native"] + ["-march=x86-64-v3", "-mno-avx512f"]
sys.path.insert(0, sys.argv[1])
import torch
from kvflow.model.quant.qlinear import available_isas
from test_decode_graph import run_both
res = {"isas": available_isas()}
for fmt, dtype, rows in (("Q4_1", torch.bfloat16, 1), ("Q8_0", torch.float32, 3), ("int8", torch.bfloat16, 8)):
    got, want, taken = run_both(fmt, dtype, "avx2", rows, decode_steps=6)
    res[fmt] = len(taken) == 6 and all(taken) and all(torch.equal(g, w) for g, w in zip(got, want))
for fmt in ("gemv", "gemv-bf16", "gemv-fp16"):  # the fp32 GEMV's AVX2 path, its most rows
    got, want, taken = run_both(fmt, torch.float32, "avx2", 4, decode_steps=3)
    res[fmt] = len(taken) == 3 and all(taken) and all(torch.equal(g, w) for g, w in zip(got, want))
from kvflow.attention.kv_layout import FP8
for name, kv in (("fp8", FP8), ("int8", torch.int8)):  # one-byte caches on their AVX2 decode row
    got, want, taken = run_both("gemv", torch.float32, "avx2", 3, decode_steps=12, kv_dtype=kv,
                                q8_isa="avx2")
    res["gemv+" + name] = len(taken) == 12 and all(taken) and all(torch.equal(g, w) for g, w in zip(got, want))
gen = torch.Generator().manual_seed(0)  # an fp8 cache's key scales, multiplied in fp32 and in bf16
scales = [torch.exp2(torch.randint(-3, 4, (2, 64), generator=gen).float()) for _ in range(3)]
for fmt, dtype in (("gemv", torch.float32), ("Q4_1", torch.bfloat16)):
    got, want, taken = run_both(fmt, dtype, "avx2", 3, decode_steps=6, kv_dtype=FP8, q8_isa="avx2",
                                key_scales=scales)
    res[fmt + "+fp8+key_scales"] = len(taken) == 6 and all(taken) and all(torch.equal(g, w) for g, w in zip(got, want))
print(json.dumps(res))
"""


@pytest.mark.slow  # builds the whole kernel library again (~12 s)
def test_avx2_build_gives_the_per_layer_numbers(tmp_path):
    """The whole kernel library built for an AVX2-only CPU (Zen 3: AVX-512 off): its one-call
    step gives its per-layer path's numbers, quantized and on the fp32 GEMV, and over fp8 and
    int8 caches on their AVX2 decode row (fp8 with key scales too, fp32 and bf16 activations)."""
    env = {**os.environ, "KVFLOW_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res.pop("isas") == ["scalar", "avx2"]
    assert res == {"Q4_1": True, "Q8_0": True, "int8": True, "gemv": True, "gemv-bf16": True,
                   "gemv-fp16": True, "gemv+fp8": True, "gemv+int8": True,
                   "gemv+fp8+key_scales": True, "Q4_1+fp8+key_scales": True}


@pytest.mark.slow  # builds two engines each
@pytest.mark.parametrize("engine_args", [
    {"dtype": "bfloat16", "quantization": "int8"},  # weights on the meta device until loaded
    {"dtype": "float32", "weight_dtype": "bfloat16"},  # the fp32 GEMV on bf16-stored panels
], ids=["int8", "fp32-gemv-bf16"])
def test_engine_greedy_tokens_with_and_without_the_graph(tmp_path, monkeypatch, engine_args):
    """LLM on a tiny Llama (quantized to int8 at load; or fp32 with bf16-stored GEMV panels):
    the same greedy tokens with the kill switch as without, and without it the decode steps
    took the one call."""
    from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3

    from kvflow import LLM, SamplingParams

    path = save_byte_tokenizer(save_tiny_llama3(str(tmp_path / "tiny")))
    prompts = [np.random.default_rng(i).integers(4, 320, n).tolist() for i, n in enumerate((9, 3, 17))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("KVFLOW_NO_DECODE_GRAPH", switch)
        llm = LLM(path, max_model_len=64, num_blocks=32, max_num_batched_tokens=16, **engine_args)
        model = llm.engine.core.executor.runner.model
        outs[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (model._decode_graph[1] is None) == (switch == "1")
        if switch == "0":
            if "weight_dtype" in engine_args:
                assert model.layers[0].packed["qkv_proj"].gemv.dtype == torch.bfloat16
            taken = count_graph_steps(model)
            llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
            assert taken == [True, True]
    assert outs["0"] == outs["1"] and all(len(t) == 12 for t in outs["0"])
