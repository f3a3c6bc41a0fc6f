"""Projections through prepacked weights: kvflow's bf16 panel GEMM (kvflow/csrc/gemm.py) on
CPUs with AVX512-BF16, else oneDNN's prepacked GEMM with the row count rounded up to a bucket.
Which one packs a model's weights is chosen once, in kvflow/model/kernels.py.

The panel GEMM streams a decode step's weights faster than oneDNN (13.4 vs 19.8 ms for the
default model's projections and LM head at one row, 12.6 vs 21.6 at eight, 43.1 vs 49.7 at
32; benchmarks/README.md) and is level with it on long prefills, with no row padding.

oneDNN builds (and caches) a GEMM primitive for every input shape it sees. A serving engine
sees a different number of tokens almost every step, so without buckets the primitive cache
fills with one-off shapes: ~1 MiB each, which showed as the engine process growing ~1 MiB per
request in the soak test until the cache's 1,024 entries were full. Rounding the rows up to a
few dozen buckets (eight per doubling) keeps the set of shapes small and the memory flat
(~0.6 MiB per shape and weight); the padded rows cost at most 7 rows below 64 and under 12.5%
above. Coarser buckets (multiples of 128 above 256) padded a serving step of 256 prompt tokens
plus 50 decodes from 306 to 384 rows: 25% more GEMM time on the steps that dominate serving."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.csrc import ops
from kvflow.csrc.gemm import (GATE_UP_ALIGN, PANEL, amx_panel_gemm, amx_panels_built,
                              pack_panels, panel_gemm)
from kvflow.csrc.gemv import gemv_f32, pack_gemv
from kvflow.model.quant.qlinear import QuantizedWeight, norm_quant_linear, quant_linear


# Rows up to which a quantized projection takes its norm or SiLU inside its own C call, and
# (decode_graph.MAX_ROWS) a decode step its decoder layers in one C call: there the calls from
# Python cost as much as the work, or, on two threads, leave the second idle while they run
# (W1's decode steps are 128 rows: 64 -> 256 took its Q4_1 run on two threads from ~499 to ~522
# output tok/s on a Zen 4). The C side keeps each intermediate in a per-thread scratch of the
# largest size it has seen, so prefill-sized rows (2048 x an 8B model's gate_up: 117 MB) stay on
# the two-step path and its short-lived tensors; 256 is vLLM's default max_num_seqs.
FUSED_ROWS = 256

# On CPUs with AMX, bf16 batches of more than AMX_PANEL_ROWS rows take AMX's tiles instead of
# the panels' AVX512-BF16 kernel, more than AMX_PANEL_ROWS_LARGE for weights of over
# AMX_LARGE_BYTES (the LM head), which stream from memory at those rows (benchmarks/amx_gemm.py,
# Xeon with AMX, one thread: the panels ahead at 1-2 rows, AMX from 4-8 rows on the projections
# and 2-14x ahead from 16; on the LM head the panels ahead to 4 rows and level at 8). The tiles
# read the same panels (gemm_amx.c): one copy of the weights; oneDNN's AMX GEMM, which needs
# its own blocked copy, serves only weights whose K is not a multiple of 32.
AMX_PANEL_ROWS = 4
AMX_PANEL_ROWS_LARGE = 8
AMX_LARGE_BYTES = 16 << 20


def amx_panel_rows(w: torch.Tensor) -> int:
    """The most rows for which the panels' AVX512-BF16 kernel serves `w` on a CPU with AMX."""
    large = w.numel() * w.element_size() > AMX_LARGE_BYTES
    return AMX_PANEL_ROWS_LARGE if large else AMX_PANEL_ROWS


@dataclass
class PackedWeight:
    """One projection's weight in the layout its GEMM reads (exactly one is set, but `gemv`
    may sit beside `onednn`, and on CPUs with AMX `onednn` beside `panels` where AMX's tiles
    cannot read the panels)."""
    panels: torch.Tensor | None = None  # kvflow's bf16 panels (kvflow/csrc/gemm.py)
    onednn: torch.Tensor | None = None  # oneDNN's blocked copy
    gemv: torch.Tensor | None = None  # GEMV panels (fp32, bf16 or fp16) for up to gemv_rows rows
    gemv_isa: str = "scalar"
    gemv_rows: int = 0
    # CPUs with AMX: batches of up to this many rows take the panels' AVX512-BF16 kernel, longer
    # ones AMX's tiles (over the panels, or oneDNN's copy where that is set); None: the panels'
    # kernel takes every batch
    panel_rows: int | None = None
    gate_up: bool = False  # panels of an MLP's [gate; up], for the GEMM with SiLU fused
    quant: QuantizedWeight | None = None  # quantized weights (kvflow/model/quant): the only copy


def onednn_available() -> bool:
    """This torch build has oneDNN's prepacked linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_available() -> bool:
    """oneDNN runs bf16 here (it may still emulate it: see CpuFeatures.native_bf16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panels_take(w: torch.Tensor) -> bool:
    """The panel GEMM serves this weight: bf16 (N, K) on the CPU, K even."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2
            and w.shape[1] % 2 == 0)


def pack_weight(w: torch.Tensor, gate_up: bool = False, *, panels: bool,
                onednn: bool, gemv_isa: str | None = None, gemv_rows: int = 0,
                gemv_dtype: torch.dtype | None = None,
                amx: bool = False, amx_tiles: bool = True) -> PackedWeight | None:
    """An (out, in) weight packed for `linear`: bf16 panels where `panels` and the kernel takes
    it, else oneDNN's layout where `onednn`; None: plain F.linear. With `amx` (a CPU with AMX)
    batches of up to amx_panel_rows(w) rows take the panels' AVX512-BF16 kernel, longer ones AMX's
    tiles over the same panels (where gemm_amx.c takes them, else oneDNN's copy beside the
    panels, when `onednn`; `amx_tiles` False: oneDNN's copy always). `gate_up`: w is an MLP's
    [gate; up], for `linear_silu_mul`. An fp32 weight also gets the GEMV's panels when
    `gemv_isa` is given: batches of up to `gemv_rows` rows read those instead (a decode step
    streams the weights at close to the memory's rate there; oneDNN's copy serves longer
    batches), stored in `gemv_dtype` (None: fp32; bf16/fp16 round w, model/weight_dtype.py).
    (kernels.py decides all of these once.)"""
    if panels and panels_take(w):
        tiles = amx and amx_tiles and amx_panels_built() and w.shape[1] % 32 == 0
        copy = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
                if onednn and amx and not tiles else None)
        rows = amx_panel_rows(w) if tiles or copy is not None else None
        if gate_up and w.shape[0] % GATE_UP_ALIGN == 0:
            return PackedWeight(panels=pack_panels(w.detach(), gate_up=True), gate_up=True,
                                onednn=copy, panel_rows=rows)
        return PackedWeight(panels=pack_panels(w.detach()), onednn=copy, panel_rows=rows)
    gemv = (gemv_isa is not None and gemv_rows > 0 and w.dtype == torch.float32
            and w.device.type == "cpu" and w.dim() == 2)
    if onednn or gemv:  # 64: a decode-sized batch hint
        return PackedWeight(
            onednn=torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64) if onednn else None,
            gemv=pack_gemv(w.detach(), gemv_dtype) if gemv else None, gemv_isa=gemv_isa if gemv else "scalar",
            gemv_rows=gemv_rows if gemv else 0)
    return None


def serves_alone(packed: PackedWeight | None) -> bool:
    """`linear` and `linear_silu_mul` never read the plain weight beside `packed`, and the
    weight can be had back bit for bit (unpack_panels): its bf16 copy can go once packed (the
    quantized load keeps none either). (An fp32 model's oneDNN and GEMV copies keep theirs.)"""
    return packed is not None and packed.quant is None and packed.panels is not None


def unpack_panels(packed: PackedWeight, n: int) -> torch.Tensor:
    """The (n, K) weight packed in `packed.panels`, bit for bit (for a released weight)."""
    p = packed.panels
    w = p.permute(0, 2, 1, 3).reshape(-1, p.shape[1] * 2)[:n]
    if packed.gate_up:
        w = w.view(n // PANEL, 2, PANEL // 2, -1).transpose(0, 1).reshape(n, -1)
    return w


def released(w: torch.Tensor) -> torch.nn.Parameter:
    """`w`'s place after packing: its shape and dtype on the meta device, no memory."""
    return torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


def panel_rows_of(packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight packed in `packed.panels` (not a gate_up pack), bit for bit: a
    tied embedding reads its table from the LM head's panels (one copy of the table)."""
    p = packed.panels
    ids = ids.reshape(-1).long()
    return p[ids // PANEL, :, ids % PANEL, :].reshape(ids.shape[0], p.shape[1] * 2)


def row_bucket(m: int) -> int:
    """Rows rounded up: powers of two to 8, then multiples of an eighth of the power of two
    below (at least 8, at most 128): 16, 24, ..., 64, 72, ..., 128, 144, ..., 256, 288, ..."""
    if m <= 8:
        return 1 << (m - 1).bit_length() if m > 0 else m
    step = min(128, max(8, 1 << (m.bit_length() - 4)))
    return -(-m // step) * step


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor, packed: PackedWeight | None,
                    silu_mul) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = [gate; up]: one kernel when w was packed with
    gate_up=True (the [M, 2I] projection is never stored and the SiLU pass is gone: ~1% of
    W1), else `linear` then `silu_mul` (the chosen one). The same numbers either way."""
    if packed is not None and packed.gate_up:
        threads = torch.get_num_threads()
        if packed.panel_rows is not None and x.shape[0] > packed.panel_rows:
            if packed.onednn is not None:
                return silu_mul(_onednn_linear(x, packed.onednn, None))
            return amx_panel_gemm(x, packed.panels, w.shape[0], None, threads, silu_mul=True)
        return panel_gemm(x, packed.panels, w.shape[0], None, threads, silu_mul=True)
    if (packed is not None and packed.quant is not None and silu_mul is ops.silu_mul
            and x.shape[0] <= FUSED_ROWS):
        return quant_linear(x, packed.quant, silu_mul=True)  # the C kernel's numbers, one call
    return silu_mul(linear(x, w, packed))


def linear(x: torch.Tensor, w: torch.Tensor, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for 2-D x: through `packed` when given, else F.linear (also for a
    gate_up pack, whose panels only linear_silu_mul reads). A quantized weight is `packed.quant`
    alone (`w` is then only its shape)."""
    if packed is not None and packed.quant is not None:
        return quant_linear(x, packed.quant, bias)
    m = x.shape[0]
    if packed is None:
        return F.linear(x, w, bias)
    if packed.panel_rows is not None and m > packed.panel_rows and packed.onednn is not None:
        return _onednn_linear(x, packed.onednn, bias)  # AMX, also for a gate_up pack
    if packed.panels is not None:
        gemm = amx_panel_gemm if packed.panel_rows is not None and m > packed.panel_rows else panel_gemm
        out = gemm(x, packed.panels, w.shape[0], bias, torch.get_num_threads())
        return _gate_up_order(out) if packed.gate_up else out
    if packed.gemv is not None and m <= packed.gemv_rows and x.dtype == torch.float32:
        return gemv_f32(x, packed.gemv, w.shape[0], bias, packed.gemv_isa, torch.get_num_threads())
    if packed.onednn is None:
        return F.linear(x, w, bias)
    return _onednn_linear(x, packed.onednn, bias)


def _gate_up_order(out: torch.Tensor) -> torch.Tensor:
    """[gate; up] columns back from a gate_up pack's order (per panel: 32 gate, then 32 up)."""
    m, n = out.shape
    return out.view(m, n // GATE_UP_ALIGN, 2, GATE_UP_ALIGN // 2).transpose(1, 2).reshape(m, n)


def _onednn_linear(x: torch.Tensor, onednn: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) through oneDNN's prepacked copy of w, the rows padded to row_bucket."""
    m = x.shape[0]
    rows = row_bucket(m)
    if rows != m:
        padded = x.new_empty(rows, x.shape[1])
        padded[:m] = x
        padded[m:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded, onednn, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                w: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None, *,
                add_rms_norm, linear, silu_mul=None) -> torch.Tensor:
    """linear(add_rms_norm(x, delta, norm_weight, eps), w, packed, bias), or with `silu_mul`
    (then `linear` is linear_silu_mul) the MLP's first half. A quantized weight under the C norm
    takes both in one C call (the same numbers): at batch 1 a call from Python costs about as
    much as the norm itself, and a decode step of the default model makes 60 of them."""
    if (packed is not None and packed.quant is not None and add_rms_norm is ops.add_rms_norm
            and x.shape[0] <= FUSED_ROWS and (silu_mul is None or silu_mul is ops.silu_mul)
            and ops.c_norm_takes(x, delta, norm_weight)):
        return norm_quant_linear(x, delta, norm_weight, eps, packed.quant, bias, silu_mul is not None)
    h = add_rms_norm(x, delta, norm_weight, eps)
    if silu_mul is None:
        return linear(h, w, packed, bias)
    return linear(h, w, packed)
