"""Tensor-level entry of the bf16 panel GEMM (gemm_bf16.c): the weight packing it reads and
the call, split over threads by rows when there are enough rows to pay for it."""
from __future__ import annotations

import torch

from kvflow.csrc import load_library, run_split

PANEL = 64  # outputs per packed panel (gemm_bf16.c)


def panel_gemm_built() -> bool:
    """The kernel library built with AVX512-BF16 (the panel GEMM's instructions)."""
    lib = load_library()
    return lib is not None and bool(lib.gemm_bf16_available())


def panel_gemm_usable(w: torch.Tensor) -> bool:
    """The panel GEMM serves this weight: bf16 (N, K) on the CPU, K even."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2
            and w.shape[1] % 2 == 0 and panel_gemm_built())


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> [ceil(N/64), K/2, 64, 2]: per panel of 64 outputs, K in pairs, so a
    panel is one contiguous stream (outputs past N are zero weights)."""
    n, k = w.shape
    padded = w.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = w
    return padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               threads: int = 1) -> torch.Tensor:
    """x [M, K] bf16 @ w.T (+ bias) -> [M, n] bf16, w given as pack_panels(w)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n)
    fn = load_library().gemm_bf16_panels
    xp, pp, op = x.data_ptr(), panels.data_ptr(), out.data_ptr()
    bp = bias.data_ptr() if bias is not None else None
    xs, panel_count = x.stride(0), panels.shape[0]
    # Few rows: the weight stream is the time, and one core streams it (13.9 ms per decode
    # step of the default model) faster than two cores split by panels (19.2 ms: each call
    # is ~0.1 ms, and waking the second thread costs a good part of that). More rows are
    # compute-bound: each thread takes its rows over all panels (the weight stays in cache).
    if threads > 1 and m >= ROW_SPLIT_ROWS:
        run_split(lambda a, b: fn(xp + 2 * a * xs, xs, b - a, k, pp, bp, op + 2 * a * n, n, n,
                                  0, panel_count), m, threads)
    else:
        fn(xp, xs, m, k, pp, bp, op, n, n, 0, panel_count)
    return out


ROW_SPLIT_ROWS = 24
