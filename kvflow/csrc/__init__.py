"""kvflow's small CPU kernels: plain C compiled once per machine with the system compiler and
called through ctypes (no torch headers, so the build takes about a second). `run_kernel`
splits a kernel's rows over kvflow's own C thread pool (pool.c).

`library()` returns None when no compiler is available or the build fails; `load_library()`
also when KVFLOW_NO_KERNELS=1. kvflow/model/kernels.py then chooses the pure-PyTorch paths."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache

import numpy as np

from kvflow import envs
from kvflow.utils.cpuinfo import march_flags, read_cpuinfo
from kvflow.utils.files import publish

logger = logging.getLogger("kvflow")

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_DIR, f) for f in ("paged_attention.c", "paged_attention_quant.c",
                                              "prefill_attention.c", "fused_ops.c", "gemm_bf16.c", "gemm_amx.c",
                                              "gemm_quant.c", "gemm_q6.c", "gemm_q4k.c", "gemm_mxfp4.c",
                                              "gemm_quant_wide.c",
                                              "gemv_f32.c", "pool.c", "populate.c", "decode_step.c", "lora.c",
                                              "state_update.c", "state_scan.c")]
_HEADERS = [os.path.join(_DIR, f) for f in ("simd.h", "kernels.h", "tiles.h", "rotation.h", "state.h",
                                            "q6.h", "panel_store.h")]  # part of the build key, not of the command line
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC", "-std=c11",
          "-pthread"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    # q, q_stride, k_cache, v_cache, tables, bt_stride, seq_lens, rows, begin, end, H, KVH, D,
    # block_size, scale, out, out_stride, io_bf16 (bit 0: q is bf16, bit 1: out is bf16),
    # window (a row of seq_len L sees keys L - window .. L - 1; 0: all), sinks (fp32 [H], each
    # query head's attention-sink logit; NULL: none)
    "paged_decode_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                         _i64, _i64, _f32, _ptr, _i64, _i64, _i64, _ptr],
    "paged_decode_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                          _i64, _i64, _f32, _ptr, _i64, _i64, _i64, _ptr],
    # q, q_stride, k_cache, v_cache, tables, bt_stride, token_start, query_len, seq_len,
    # work_begin, work_end, H, KVH, D, block_size, scale, out, out_stride, out_bf16, window (a
    # query at position p sees keys p - window + 1 .. p; 0: all), kv_kind (0 bf16, 1 int8, 2
    # fp8: a one-byte cache widened into its scratch), fp8's scale as float32 bits, isa (0:
    # AVX512-BF16, 1: AMX where prefill_amx_available()), sinks (as the decode kernels')
    "paged_prefill_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                           _i64, _i64, _i64, _i64, _f32, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                           _ptr],
    # residual, delta, weight, out, begin, end, n, eps
    "add_rms_norm_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _f32],
    "add_rms_norm_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _f32],
    # qkv, stride, positions, cos, sin, begin, end, n_heads, dim
    "rope_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "rope_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    # gate_up, out, begin, end, n
    "silu_mul_f32": [_ptr, _ptr, _i64, _i64, _i64],
    "silu_mul_bf16": [_ptr, _ptr, _i64, _i64, _i64],
    # k, v, src_stride, slots, k_cache, v_cache, begin, end, KVH, D, block_size
    "write_kv_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "write_kv_bf16": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "copy_kv_bf16": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    # logits, row stride, out (int64), begin, end, n
    "argmax_rows_bf16": [_ptr, _i64, _ptr, _i64, _i64, _i64],
    # x, x_stride, M, K, packed, bias, out, out_stride, N, panel_begin, panel_end, silu_mul
    "gemm_bf16_panels": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    # x, x_stride, K, Kb, bf16, per_row, qx, dx, dxs, begin, end
    "quantize_rows_q8": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    # qx, dx, dxs, Kb, M, packed, kind, isa, bias, out, out_stride, N, out_bf16, p_begin, p_end
    "gemm_quant_panels": [_ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64,
                          _i64, _i64, _i64],
    # k, v, src_stride, slots, k_cache, v_cache, begin, end, KVH, D, block_size, kind (0 int8,
    # 1 fp8), src_bf16, k_scale bits, v_scale bits (fp8's per-tensor scales as float32 bits)
    "write_kv_q8": [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                    _i64, _i64],
    # x, rows, D: the fp8 cache's rotation of each row, in place (the tests')
    "hadamard_rotate_rows": [_ptr, _i64, _i64],
    # x, x_stride, M, K, packed, bias, out, out_stride, N, isa, wdt, p_begin, p_end
    "gemv_f32_panels": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                        _i64],
    # buffer, bytes, page size
    "populate_pages": [_ptr, _i64, _i64],
}


def _cpu_id() -> str:
    """What the compiled code depends on: -march=native ties a build to this CPU."""
    info = read_cpuinfo()
    return platform.machine() + info.model_name + " ".join(sorted(info.flags))


def _build_flags() -> list[str]:
    """_FLAGS with -march=native replaced by KVFLOW_CPU_ISA's target where it caps the CPU."""
    return [g for f in _FLAGS for g in (march_flags() if f == "-march=native" else [f])]


def _build_dir() -> str:
    return os.path.join(envs.cache_dir(), "kernels")


def load_library() -> ctypes.CDLL | None:
    """The kernel library, unless KVFLOW_NO_KERNELS=1 opts out (read on each call: call it at
    load, not per kernel)."""
    return None if envs.KVFLOW_NO_KERNELS else library()


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """Compile (once, cached by sources, flags and CPU) and load the kernel library; None where
    that fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("kvflow: no C compiler found; using the PyTorch paths")
        return None
    flags = _build_flags()
    digest = hashlib.sha256(" ".join(flags).encode() + _cpu_id().encode())
    for src in _SOURCES + _HEADERS:
        with open(src, "rb") as f:
            digest.update(f.read())
    out_dir = _build_dir()
    lib_path = os.path.join(out_dir, f"kvflow_kernels-{digest.hexdigest()[:16]}.so")
    if not os.path.isfile(lib_path):
        tmp = None
        try:
            os.makedirs(out_dir, exist_ok=True)
            # build privately, then publish (fsync + rename) as the other caches do:
            # concurrent starts never load a half-written file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            subprocess.run([cc, *flags, *_SOURCES, "-o", tmp, "-lm"], check=True,
                           capture_output=True, timeout=120)
            publish(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)  # no half-built library left behind
            err = getattr(e, "stderr", b"") or b""
            logger.warning("kvflow: building the C kernels failed (%s %s); using the PyTorch paths",
                           e, err.decode(errors="replace")[-500:])
            return None
    lib = ctypes.CDLL(lib_path)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.gemm_quant_isas.restype, lib.gemm_quant_isas.argtypes = _i64, []
    lib.gemm_quant_wide_isas.restype, lib.gemm_quant_wide_isas.argtypes = _i64, []
    lib.gemm_mxfp4_isas.restype, lib.gemm_mxfp4_isas.argtypes = _i64, []
    lib.gemv_f32_isas.restype, lib.gemv_f32_isas.argtypes = _i64, []
    lib.lora_isas.restype, lib.lora_isas.argtypes = _i64, []
    lib.state_update_isas.restype, lib.state_update_isas.argtypes = _i64, []
    lib.paged_decode_q8_isas.restype, lib.paged_decode_q8_isas.argtypes = _i64, []
    lib.hadamard_lanes.restype, lib.hadamard_lanes.argtypes = _i64, []
    lib.paged_decode_q8_serves.restype = _i64
    lib.paged_decode_q8_serves.argtypes = [_i64, _i64, _i64]
    # x, x_stride, K, Kb, x_bf16, per_row, packed, kind, isa, bias, out, N, out_bf16, M, threads,
    # wide_rows, silu_mul
    lib.quant_linear.restype = _i64
    lib.quant_linear.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr,
                                 _i64, _i64, _i64, _i64, _i64, _i64]
    # residual, delta, norm_weight, eps, then quant_linear's words from K on
    lib.quant_linear_normed.restype = _i64
    lib.quant_linear_normed.argtypes = [_ptr, _ptr, _ptr, ctypes.c_double, _i64, _i64, _i64, _i64,
                                        _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                        _i64]
    # step words, layer records, number of layers (decode_step.c; kvflow/model/decode_graph.py)
    lib.decode_layers.restype, lib.decode_layers.argtypes = _i64, [_ptr, _ptr, _i64]
    lib.decode_step_layout.restype, lib.decode_step_layout.argtypes = _i64, [_i64]
    lib.gemm_bf16_available.restype, lib.gemm_bf16_available.argtypes = ctypes.c_int, []
    lib.prefill_amx_available.restype, lib.prefill_amx_available.argtypes = ctypes.c_int, []
    lib.gemm_amx_available.restype, lib.gemm_amx_available.argtypes = ctypes.c_int, []
    lib.paged_prefill_bf16_supported.restype = ctypes.c_int
    lib.paged_prefill_bf16_supported.argtypes = [_i64, _i64, _i64, _i64]
    lib.kernel_pool_run.restype = None
    lib.kernel_pool_run.argtypes = [_i64, _ptr, ctypes.c_double, _i64, _ptr, _i64]
    lib.kernel_pool_num_kernels.restype, lib.kernel_pool_num_kernels.argtypes = _i64, []
    assert lib.kernel_pool_num_kernels() == len(POOL_KERNELS), "pool.c's KERNELS and POOL_KERNELS differ"
    return lib


# pool.c's KERNELS, in its order: what `run_kernel` can split, each with its argument words
POOL_KERNELS = {name: i for i, name in enumerate((
    "paged_decode_f32", "paged_decode_bf16", "paged_prefill_bf16", "add_rms_norm_f32",
    "add_rms_norm_bf16", "rope_f32", "rope_bf16", "silu_mul_f32", "silu_mul_bf16",
    "gemm_rows", "gemm_panels", "quantize_q8", "qgemm_rows", "qgemm_panels",
    "qgemm_wide", "gemv_f32", "lora", "paged_decode_q8", "causal_conv", "gdn_decode",
    "ssm_decode", "ssm_gated_norm", "gdn_chunk", "ssm_chunk", "gdn_gated_norm", "gemm_amx"))}


def run_kernel(name: str, words: list, num_rows: int, threads: int, farg: float = 0.0,
               weights: np.ndarray | None = None) -> None:
    """Run a pool kernel over rows [0, num_rows) on `threads` threads (the caller's and pool
    workers'), in contiguous ranges of about equal weight (row count, or int64 `weights`).
    `words` are its arguments as pool.c lists them (pointers as ints, None for NULL)."""
    args = (ctypes.c_int64 * len(words))(*(w or 0 for w in words))
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.int64)
    library().kernel_pool_run(POOL_KERNELS[name], args, farg, num_rows,
                                   None if weights is None else weights.ctypes.data, threads)
