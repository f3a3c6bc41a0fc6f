"""Tensor-level entry of the state layers' kernels (state_update.c, state_scan.c): the causal
conv over a step's requests (decodes and prompt chunks, with their carried windows), Gated
DeltaNet's and Mamba2's one-token state updates and their prompt chunks, their instruction
sets, and the calls, split over the kernel pool. Each reads and writes the states in their
slots in place; the PyTorch references are kvflow/layers/causal_conv.py's `causal_conv1d`,
gated_deltanet.py's `recurrent_gated_delta_rule` / `chunk_gated_delta_rule` and mamba2.py's
`recurrent_scan` / `chunk_scan`."""
from __future__ import annotations

import struct
from functools import lru_cache, partial
from types import SimpleNamespace

import numpy as np
import torch

from kvflow.csrc import library, run_kernel

STATE_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # state_update.c's `isa` codes
CONV_BLOCK = 128  # channels per conv work unit (state_update.c)
CONV_MAX_TAPS = 8
HEAD_MAX = 512  # the widest head dims (dk, dv, P, N) the kernels hold on their stack
MIN_PARALLEL_VALUES = 1 << 15  # state values touched below which one thread runs the call


def state_isas() -> list[str]:
    """The paths the kernel library was built with, narrowest first."""
    lib = library()
    if lib is None:
        return []
    bits = int(lib.state_update_isas())
    return [name for name, code in STATE_ISAS.items() if bits >> code & 1]


def best_state_isa(features) -> str:
    """The widest path both the build and the CPU offer (scalar at least)."""
    built = state_isas()
    if "avx512" in built and features.avx512:
        return "avx512"
    if "avx2" in built and {"avx2", "fma"} <= features.flags:
        return "avx2"
    return "scalar"


def supports(dtype: torch.dtype, *dims: int) -> bool:
    """Whether the kernels take activations of `dtype` and heads of these dims (else the
    PyTorch paths serve)."""
    return dtype in (torch.float32, torch.bfloat16) and all(0 < d <= HEAD_MAX for d in dims)


def _threads(values: int) -> int:
    return torch.get_num_threads() if values >= MIN_PARALLEL_VALUES else 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_of(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: expected a [T, width] tensor with contiguous rows, got "
                         f"{tuple(x.shape)} strides {x.stride()}")


def causal_conv(conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor, starts: np.ndarray, lens: np.ndarray, slots: np.ndarray,
                saves: dict, silu: bool, isa: str) -> torch.Tensor:
    """causal_conv1d's result (then SiLU where `silu`) in x's dtype, its windows moved on in
    `conv_state` [slots, taps, C] and its snapshots (`saves`: request -> (after, slot)) kept.
    x [T, C] (rows may be strided), starts [N + 1], lens and slots [N]."""
    _rows_of(x, "causal_conv")
    c, k = weight.shape
    if not (x.dtype == conv_state.dtype == weight.dtype and x.shape[1] == c
            and conv_state.shape[1:] == (k - 1, c) and conv_state.is_contiguous()
            and weight.is_contiguous() and 1 < k <= CONV_MAX_TAPS):
        raise ValueError(f"causal_conv: x {tuple(x.shape)} {x.dtype}, state "
                         f"{tuple(conv_state.shape)} {conv_state.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not fit")
    n, t = len(lens), x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype)
    starts = np.ascontiguousarray(starts[:n], dtype=np.int64)
    lens = np.ascontiguousarray(lens, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    snap_after = snap_slot = None  # NULL: no snapshots this step
    if saves:
        snap_after, snap_slot = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for i, (after, snap) in saves.items():
            snap_after[i], snap_slot[i] = after, snap
    blocks = -(-c // CONV_BLOCK)
    bias = None if bias is None else bias.contiguous()
    # a mixed batch's units weigh their tokens (a decode-only batch's are equal)
    weights = None if t == n else np.repeat(lens + 1, blocks)
    run_kernel("causal_conv", [x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                               conv_state.data_ptr(), weight.data_ptr(), _ptr(bias),
                               starts.ctypes.data, lens.ctypes.data, slots.ctypes.data,
                               snap_after.ctypes.data if saves else None,
                               snap_slot.ctypes.data if saves else None, c, k,
                               int(x.dtype == torch.bfloat16), int(silu), STATE_ISAS[isa]],
               n * blocks, _threads(t * c * k), weights=weights)
    return out


def gated_delta_decode(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, rows: np.ndarray,
                       slots: np.ndarray, out: torch.Tensor, num_k_heads: int, isa: str,
                       gate: tuple | None = None) -> None:
    """Gated DeltaNet's recurrent step for one token of each request: x [T, 2 nk dk + nv dv]
    (the conv's q|k|v after SiLU), ba [T, 2 nv] (b, then a; rows may be strided), state
    [slots, nv, dk, dv] fp32 updated in place at `slots`; out [T, nv, dv] fp32 gets rows
    `rows`. With `gate` = (z [T, nv dv], norm weight [dv], eps) out is instead in x's dtype
    and gets the gated norm of those rows (the layer's _gated_norm)."""
    _rows_of(x, "gated_delta_decode")
    _rows_of(ba, "gated_delta_decode")
    _, nv, dk, dv = state.shape
    out_dtype = torch.float32 if gate is None else x.dtype
    if not (x.dtype == ba.dtype and state.dtype == torch.float32 and out.dtype == out_dtype
            and state.is_contiguous() and out.is_contiguous() and out.shape[1:] == (nv, dv)
            and x.shape[1] == 2 * num_k_heads * dk + nv * dv and ba.shape[1] == 2 * nv
            and nv % num_k_heads == 0 and a_log.dtype == dt_bias.dtype == torch.float32):
        raise ValueError(f"gated_delta_decode: x {tuple(x.shape)}, ba {tuple(ba.shape)}, state "
                         f"{tuple(state.shape)} and out {tuple(out.shape)} {out.dtype} do not fit")
    z = norm = None
    eps = 0.0
    if gate is not None:
        z, norm, eps = gate
        _rows_of(z, "gated_delta_decode")
        if not (z.dtype == norm.dtype == x.dtype and z.shape[1] == nv * dv and norm.shape == (dv,)):
            raise ValueError(f"gated_delta_decode: gate z {tuple(z.shape)} {z.dtype} and norm "
                             f"{tuple(norm.shape)} {norm.dtype} do not fit")
        norm = norm.contiguous()
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    run_kernel("gdn_decode", [x.data_ptr(), x.stride(0), ba.data_ptr(), ba.stride(0),
                              a_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(),
                              rows.ctypes.data, slots.ctypes.data,
                              None if gate else out.data_ptr(), num_k_heads, nv, dk, dv,
                              _ptr(z), 0 if z is None else z.stride(0), _ptr(norm),
                              out.data_ptr() if gate else None, nv * dv,
                              int(x.dtype == torch.bfloat16), STATE_ISAS[isa]],
               len(rows) * nv, _threads(len(rows) * nv * dk * dv), farg=eps)


def gdn_gated_norm(out: torch.Tensor, z: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output of a step: the layer's _gated_norm of out [T, nv, dv] fp32 (the
    recurrence's, rounded to z's dtype first) with z [T, nv dv] (rows may be strided) and the
    norm weight [dv]; [T, nv, dv] in z's dtype."""
    _rows_of(z, "gdn_gated_norm")
    t, nv, dv = out.shape
    if not (out.dtype == torch.float32 and out.is_contiguous() and z.shape == (t, nv * dv)
            and norm.dtype == z.dtype and norm.shape == (dv,) and dv <= HEAD_MAX):
        raise ValueError(f"gdn_gated_norm: out {tuple(out.shape)} {out.dtype}, z {tuple(z.shape)} "
                         f"and norm {tuple(norm.shape)} {norm.dtype} do not fit")
    gated = torch.empty(t, nv, dv, dtype=z.dtype)
    norm = norm.contiguous()
    run_kernel("gdn_gated_norm", [out.data_ptr(), z.data_ptr(), z.stride(0), norm.data_ptr(),
                                  gated.data_ptr(), nv * dv, nv, dv, int(z.dtype == torch.bfloat16)],
               t * nv, _threads(t * nv * dv * 8), farg=eps)
    return gated


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def ssm_decode(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, rows: np.ndarray, slots: np.ndarray, y: torch.Tensor,
               n_groups: int, dt_limit: tuple[float, float], isa: str) -> None:
    """Mamba2's selective state update for one token of each request: x [T, nh P + 2 G N]
    (the conv's x|B|C after SiLU), dt [T, nh] raw (rows may be strided), state
    [slots, nh, P, N] fp32 updated in place at `slots`; y [T, nh, P] fp32 gets rows `rows`
    (without the D skip)."""
    _rows_of(x, "ssm_decode")
    _rows_of(dt, "ssm_decode")
    _, nh, p, n = state.shape
    if not (x.dtype == dt.dtype and state.dtype == y.dtype == torch.float32
            and state.is_contiguous() and y.is_contiguous() and y.shape[1:] == (nh, p)
            and x.shape[1] == nh * p + 2 * n_groups * n and dt.shape[1] == nh
            and nh % n_groups == 0 and a_log.dtype == dt_bias.dtype == torch.float32):
        raise ValueError(f"ssm_decode: x {tuple(x.shape)}, dt {tuple(dt.shape)}, state "
                         f"{tuple(state.shape)} and y {tuple(y.shape)} do not fit")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    run_kernel("ssm_decode", [x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0),
                              a_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(),
                              rows.ctypes.data, slots.ctypes.data, y.data_ptr(), nh, n_groups, p,
                              n, _f32_bits(dt_limit[0]), _f32_bits(dt_limit[1]),
                              int(x.dtype == torch.bfloat16), STATE_ISAS[isa]],
               len(rows) * nh, _threads(len(rows) * nh * p * n))


def ssm_gated_norm(y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, d: torch.Tensor,
                   norm: torch.Tensor, eps: float, n_groups: int) -> torch.Tensor:
    """Mamba2's output in a decode-only step: (y + D x) silu(z), RMS-normed over each group's
    channels, times the weight, in x's dtype [T, nh P]. y [T, nh, P] fp32 (the scan's), x
    [T, >= nh P] (the conv's output), z [T, nh P] (rows may be strided), D [nh] fp32."""
    _rows_of(x, "ssm_gated_norm")
    _rows_of(z, "ssm_gated_norm")
    t, nh, p = y.shape
    width = nh * p
    if not (y.dtype == d.dtype == torch.float32 and y.is_contiguous() and x.dtype == z.dtype
            == norm.dtype and z.shape == (t, width) and norm.shape == (width,)
            and x.shape[1] >= width and width % n_groups == 0
            and width // n_groups <= 8 * HEAD_MAX):
        raise ValueError(f"ssm_gated_norm: y {tuple(y.shape)}, x {tuple(x.shape)}, z "
                         f"{tuple(z.shape)} and norm {tuple(norm.shape)} do not fit")
    out = torch.empty(t, width, dtype=x.dtype)
    d, norm = d.contiguous(), norm.contiguous()
    run_kernel("ssm_gated_norm", [y.data_ptr(), x.data_ptr(), x.stride(0), z.data_ptr(),
                                  z.stride(0), d.data_ptr(), norm.data_ptr(), out.data_ptr(), nh,
                                  p, n_groups, int(x.dtype == torch.bfloat16)],
               t, _threads(t * width * 8), farg=eps)
    return out


def _chunks(starts: np.ndarray, lens: np.ndarray, slots: np.ndarray, saves: dict):
    """The chunks' int64 arrays for the kernels, and their snapshots' (None, None: none)."""
    n = len(lens)
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (starts[:n], lens, slots)]
    snap_after = snap_slot = None
    if saves:
        snap_after, snap_slot = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for i, (after, snap) in saves.items():
            snap_after[i], snap_slot[i] = after, snap
    return arrays, snap_after, snap_slot


def gated_delta_chunks(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, starts: np.ndarray,
                       lens: np.ndarray, slots: np.ndarray, saves: dict, out: torch.Tensor,
                       num_k_heads: int, isa: str) -> None:
    """Gated DeltaNet over prompt chunks, token after token: chunk i is rows
    [starts[i], starts[i] + lens[i]) of x [T, 2 nk dk + nv dv] (the conv's q|k|v after SiLU)
    and ba [T, 2 nv] (b, then a; rows may be strided), its state in slot slots[i] of state
    [slots, nv, dk, dv] fp32, moved on in place; `saves` (chunk -> (after, slot)) keeps the
    state after a token in a snapshot slot. out [T, nv, dv] fp32 gets the chunks' rows."""
    _rows_of(x, "gated_delta_chunks")
    _rows_of(ba, "gated_delta_chunks")
    _, nv, dk, dv = state.shape
    if not (x.dtype == ba.dtype and state.dtype == out.dtype == torch.float32
            and state.is_contiguous() and out.is_contiguous() and out.shape[1:] == (nv, dv)
            and x.shape[1] == 2 * num_k_heads * dk + nv * dv and ba.shape[1] == 2 * nv
            and nv % num_k_heads == 0 and a_log.dtype == dt_bias.dtype == torch.float32):
        raise ValueError(f"gated_delta_chunks: x {tuple(x.shape)}, ba {tuple(ba.shape)}, state "
                         f"{tuple(state.shape)} and out {tuple(out.shape)} {out.dtype} do not fit")
    (starts, lens, slots), snap_after, snap_slot = _chunks(starts, lens, slots, saves)
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    threads = _threads(int(lens.sum()) * dk * dv)
    # more threads than heads to split: each head's columns in groups of 32 or more (a group
    # prepares its tokens' q and k again, so no more groups than the threads need)
    cols = max(1, min(dv // 32, -(-threads // (len(lens) * nv))))
    run_kernel("gdn_chunk", [x.data_ptr(), x.stride(0), ba.data_ptr(), ba.stride(0),
                             a_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(),
                             starts.ctypes.data, lens.ctypes.data, slots.ctypes.data,
                             None if snap_after is None else snap_after.ctypes.data,
                             None if snap_slot is None else snap_slot.ctypes.data,
                             out.data_ptr(), num_k_heads, nv, dk, dv, cols,
                             int(x.dtype == torch.bfloat16), STATE_ISAS[isa]],
               len(lens) * nv * cols, threads, weights=np.repeat(lens, nv * cols))


def ssm_chunks(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, starts: np.ndarray, lens: np.ndarray, slots: np.ndarray,
               saves: dict, y: torch.Tensor, n_groups: int, dt_limit: tuple[float, float],
               isa: str) -> None:
    """Mamba2's SSD over prompt chunks, token after token: chunk i is rows
    [starts[i], starts[i] + lens[i]) of x [T, nh P + 2 G N] (the conv's x|B|C after SiLU) and
    dt [T, nh] raw (rows may be strided), its state in slot slots[i] of state [slots, nh, P, N]
    fp32, moved on in place; snapshots as gated_delta_chunks'. y [T, nh, P] fp32 gets the
    chunks' rows (without the D skip)."""
    _rows_of(x, "ssm_chunks")
    _rows_of(dt, "ssm_chunks")
    _, nh, p, n = state.shape
    if not (x.dtype == dt.dtype and state.dtype == y.dtype == torch.float32
            and state.is_contiguous() and y.is_contiguous() and y.shape[1:] == (nh, p)
            and x.shape[1] == nh * p + 2 * n_groups * n and dt.shape[1] == nh
            and nh % n_groups == 0 and a_log.dtype == dt_bias.dtype == torch.float32):
        raise ValueError(f"ssm_chunks: x {tuple(x.shape)}, dt {tuple(dt.shape)}, state "
                         f"{tuple(state.shape)} and y {tuple(y.shape)} do not fit")
    (starts, lens, slots), snap_after, snap_slot = _chunks(starts, lens, slots, saves)
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    run_kernel("ssm_chunk", [x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0),
                             a_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(),
                             starts.ctypes.data, lens.ctypes.data, slots.ctypes.data,
                             None if snap_after is None else snap_after.ctypes.data,
                             None if snap_slot is None else snap_slot.ctypes.data,
                             y.data_ptr(), nh, n_groups, p, n, _f32_bits(dt_limit[0]),
                             _f32_bits(dt_limit[1]), int(x.dtype == torch.bfloat16),
                             STATE_ISAS[isa]],
               len(lens) * nh, _threads(int(lens.sum()) * p * n), weights=np.repeat(lens, nh))


@lru_cache(maxsize=None)
def ops(isa: str) -> SimpleNamespace:
    """The state layers' operations on this CPU's path `isa`, by the names the layers call (the
    GPU's are kvflow/model/triton/state_scan.py's `ops()`); built once per path."""
    return SimpleNamespace(name=f"c-{isa}", causal_conv=partial(causal_conv, isa=isa),
                           gated_delta_decode=partial(gated_delta_decode, isa=isa),
                           gated_delta_chunks=partial(gated_delta_chunks, isa=isa),
                           ssm_decode=partial(ssm_decode, isa=isa), ssm_chunks=partial(ssm_chunks, isa=isa))
