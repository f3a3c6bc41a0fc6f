"""The Triton kernels compiled ahead of time for an H200 (sm_90) on this CPU machine: Triton
ships ptxas, so what the interpreter cannot show (types, dot shapes, register and shared memory
limits, the bf16 dot path) is checked before any GPU time is spent. The shapes are Llama-3-8B's
(32 heads, 8 KV heads, head_dim 128) and SmolLM2-135M's (9 / 3, 64), bf16, with the launch
parameters the wrappers in kvflow/model/triton/ choose."""
from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

# ~3 s per kernel variant; Triton 3.9 warns that its FP-fusion default will change (not ours)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")]

H200 = ("cuda", 90, 32)
SHAPES = {"llama3-8b": dict(heads=32, kv=8, d=128), "smollm2-135m": dict(heads=9, kv=3, d=64)}


def _compile(fn, types: dict, consts: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real @triton.jit"
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget(*H200))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 228 * 1024  # H200: 228 KiB per SM
    return kernel


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,cap,sinks", [(False, False, False), (True, True, True)])
def test_decode_and_merge_compile_for_h200(shape, window, cap, sinks):
    from kvflow.model.triton import paged_decode as m
    s = SHAPES[shape]
    group = s["heads"] // s["kv"]
    _compile(m._decode_split_kernel,
             dict(q_ptr="*bf16", k_cache="*bf16", v_cache="*bf16", k_scales="*bf16",
                  v_scales="*bf16", block_tables="*i32", seq_lens="*i32", part_out="*fp32", part_lse="*fp32", scale="fp32", cap="fp32",
                  window="i32", k_fp8_scale="fp32", v_fp8_scale="fp32", stride_q_tok="i32", stride_q_head="i32", stride_bt="i32"),
             dict(NUM_SPLITS=16, HEADS=s["heads"], KV_HEADS=s["kv"], HEAD_DIM=s["d"], BLOCK_SIZE=16,
                  GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 2), BLOCK_D=s["d"],
                  BLOCK_N=16, USE_CAP=cap, USE_WINDOW=window, KV_KIND=0))
    _compile(m._merge_splits_kernel,
             dict(part_out="*fp32", part_lse="*fp32", out_ptr="*bf16", sinks_ptr="*fp32",
                  stride_o_tok="i32", stride_o_head="i32"),
             dict(NUM_SPLITS=16, HEADS=s["heads"], HEAD_DIM=s["d"], BLOCK_S=16, BLOCK_D=s["d"],
                  HAS_SINKS=sinks))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,cap,sinks", [(False, False, False), (True, True, True)])
def test_prefill_compiles_for_h200_with_bf16_dots(shape, window, cap, sinks):
    from kvflow.model.triton import paged_prefill as m
    s = SHAPES[shape]
    _compile(m._prefill_kernel,
             dict(q_ptr="*bf16", k_cache="*bf16", v_cache="*bf16", k_scales="*bf16",
                  v_scales="*bf16", block_tables="*i32", seq_lens="*i32", query_start_loc="*i32", out_ptr="*bf16", sinks_ptr="*fp32",
                  scale="fp32", cap="fp32", window="i32", k_fp8_scale="fp32", v_fp8_scale="fp32", stride_q_tok="i32", stride_q_head="i32",
                  stride_o_tok="i32", stride_o_head="i32", stride_bt="i32"),
             dict(KV_HEADS=s["kv"], GROUP=s["heads"] // s["kv"], HEAD_DIM=s["d"], BLOCK_SIZE=16,
                  BLOCK_M=32, BLOCK_N=32, BLOCK_D=s["d"], USE_CAP=cap, USE_WINDOW=window,
                  DOT_FP32=False, PRECISION="tf32", KV_KIND=0, HAS_SINKS=sinks))


def test_kv_write_and_fused_ops_compile_for_h200():
    from kvflow.model.triton import fused_ops, kv_write
    _compile(kv_write._write_kv_kernel,
             dict(k_ptr="*bf16", v_ptr="*bf16", k_cache="*bf16", v_cache="*bf16",
                  k_scales="*bf16", v_scales="*bf16", slot_mapping="*i64", k_fp8_scale="fp32", v_fp8_scale="fp32", stride_k_tok="i32", stride_k_head="i32",
                  stride_v_tok="i32", stride_v_head="i32"),
             dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_KIND=0))
    _compile(fused_ops._add_rms_norm_kernel,
             dict(x_ptr="*bf16", delta_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_x="i32",
                  stride_d="i32", stride_o="i32", n="i32", eps="fp32"),
             dict(HAS_DELTA=True, BLOCK=4096))
    _compile(fused_ops._silu_mul_kernel,
             dict(gu_ptr="*bf16", out_ptr="*bf16", stride_gu="i32", stride_o="i32", n="i32"),
             dict(BLOCK=1024))
    _compile(fused_ops._rope_kernel,
             dict(qkv_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
                  stride_t="i32", stride_pos="i32", n_heads="i32"),
             dict(HEAD_DIM=128, BLOCK_H=16, BLOCK_J=64))


@pytest.mark.parametrize("kind,cache,scales", [(1, "*i8", "*fp32"), (2, "*u8", "*fp8e4nv")])
def test_one_byte_kv_cache_kernels_compile_for_h200(kind, cache, scales):
    """The int8 (1) and fp8 (2) caches' write, decode and prompt kernels, Llama-3-8B's shape."""
    from kvflow.model.triton import kv_write, paged_decode, paged_prefill
    kv = dict(k_cache=cache, v_cache=cache, k_scales=scales, v_scales=scales)
    _compile(kv_write._write_kv_kernel,
             dict(k_ptr="*bf16", v_ptr="*bf16", slot_mapping="*i64", k_fp8_scale="fp32", v_fp8_scale="fp32", stride_k_tok="i32",
                  stride_k_head="i32", stride_v_tok="i32", stride_v_head="i32", **kv),
             dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_KIND=kind))
    _compile(paged_decode._decode_split_kernel,
             dict(q_ptr="*bf16", block_tables="*i32", seq_lens="*i32", part_out="*fp32",
                  part_lse="*fp32", scale="fp32", cap="fp32", window="i32", k_fp8_scale="fp32", v_fp8_scale="fp32", stride_q_tok="i32",
                  stride_q_head="i32", stride_bt="i32", **kv),
             dict(NUM_SPLITS=16, HEADS=32, KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, GROUP=4,
                  BLOCK_G=4, BLOCK_D=128, BLOCK_N=16, USE_CAP=False, USE_WINDOW=False,
                  KV_KIND=kind))
    _compile(paged_prefill._prefill_kernel,
             dict(q_ptr="*bf16", block_tables="*i32", seq_lens="*i32", query_start_loc="*i32",
                  out_ptr="*bf16", sinks_ptr="*fp32", scale="fp32", cap="fp32", window="i32",
                  k_fp8_scale="fp32", v_fp8_scale="fp32", stride_q_tok="i32",
                  stride_q_head="i32", stride_o_tok="i32", stride_o_head="i32", stride_bt="i32",
                  **kv),
             dict(KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=32,
                  BLOCK_D=128, USE_CAP=False, USE_WINDOW=False, DOT_FP32=False,
                  PRECISION="tf32", KV_KIND=kind, HAS_SINKS=False))


@pytest.mark.parametrize("shape", ["qwen3.5-0.8b", "granite-4.0-h-tiny"])
def test_state_kernels_compile_for_h200(shape):
    """The state layers' kernels (kvflow/model/triton/state_update.py, state_scan.py) at the
    launch parameters their wrappers choose: Qwen3.5-0.8B's Gated DeltaNet (16 q/k and 16 v
    heads of 128, conv channels 6144) or Granite-4.0-H-tiny's Mamba2 (48 heads of 64, state
    128, 1 group, conv channels 3328), bf16 activations, fp32 states."""
    from kvflow.model.triton import state_scan as scan
    from kvflow.model.triton import state_update as step
    chunks = dict(starts_ptr="*i64", lens_ptr="*i64", slots_ptr="*i64", snap_after_ptr="*i64",
                  snap_slot_ptr="*i64")
    gdn = shape == "qwen3.5-0.8b"
    _compile(scan._conv_kernel,
             dict(x_ptr="*bf16", stride_x="i32", out_ptr="*bf16", stride_o="i32", state_ptr="*bf16",
                  w_ptr="*bf16", bias_ptr="*bf16", C="i32", **chunks),
             dict(TAPS=3, K_P2=4, TAPS_P2=4, HAS_BIAS=not gdn, SILU=True, HAS_SNAP=True, BLOCK_C=256))
    if gdn:
        common = dict(x_ptr="*bf16", stride_x="i32", ba_ptr="*bf16", stride_ba="i32",
                      a_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32", out_ptr="*fp32",
                      scale="fp32")
        consts = dict(NK=16, NV=16, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32)
        _compile(step._gdn_decode_kernel, dict(common, rows_ptr="*i64", slots_ptr="*i64"), consts)
        _compile(scan._gdn_chunk_kernel, dict(common, **chunks), consts)
    else:
        common = dict(x_ptr="*bf16", stride_x="i32", dt_ptr="*bf16", stride_dt="i32",
                      a_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32", y_ptr="*fp32",
                      dt_min="fp32", dt_max="fp32")
        consts = dict(NH=48, G=1, P=64, N=128, BLOCK_P=16, BLOCK_N=128)
        _compile(step._ssm_decode_kernel, dict(common, rows_ptr="*i64", slots_ptr="*i64"), consts)
        _compile(scan._ssm_chunk_kernel, dict(common, **chunks), consts)
