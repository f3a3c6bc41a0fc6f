"""Tensor-level entry of the bf16 panel GEMM (gemm_bf16.c): the weight packing it reads and
the call, split over threads by rows when there are enough rows to pay for it."""
from __future__ import annotations

import torch

from kvflow.csrc import library, run_kernel

PANEL = 64  # outputs per packed panel (gemm_bf16.c)
GATE_UP_ALIGN = PANEL  # [gate; up] rows fused with SiLU: a whole panel of 32 gate + 32 up each


def panel_gemm_built() -> bool:
    """The kernel library built with AVX512-BF16 (the panel GEMM's instructions)."""
    lib = library()
    return lib is not None and bool(lib.gemm_bf16_available())


def pack_panels(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """(N, K) bf16 -> [ceil(N/64), K/2, 64, 2]: per panel of 64 outputs, K in pairs, so a
    panel is one contiguous stream (outputs past N are zero weights). `gate_up`: w is an
    MLP's [gate; up] (N = 2I, I a multiple of 32), packed for panel_gemm(silu_mul=True):
    panel p holds gate rows 32p..32p+31, then the same up rows."""
    n, k = w.shape
    if gate_up:
        assert n % GATE_UP_ALIGN == 0, f"gate/up rows {n} are not whole pairs of 32"
        w = w.view(2, n // PANEL, PANEL // 2, k).transpose(0, 1).reshape(n, k)
    if n % PANEL:  # (a whole number of panels needs no padded copy: one LM head less at load)
        padded = w.new_zeros(-(-n // PANEL) * PANEL, k)
        padded[:n] = w
        w = padded
    return w.contiguous().view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               threads: int = 1, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ w.T (+ bias) -> [M, n] bf16, w given as pack_panels(w). With
    `silu_mul`, w = [gate; up] packed with gate_up=True and n = 2I: -> silu(gate) * up [M, I],
    rounded as silu_mul(x @ w.T) is."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n // 2 if silu_mul else n)
    words = [x.data_ptr(), x.stride(0), k, panels.data_ptr(),
             bias.data_ptr() if bias is not None else None, out.data_ptr(), out.shape[1], n, m,
             int(silu_mul)]
    # Many rows are compute-bound: each thread takes its rows over all panels (a panel is
    # reread from L2 per tile of rows). Fewer rows split by panels, each thread streaming its
    # own share of the weight: the model's projections on two threads took 9.3 ms at one row
    # (one thread 11.8) and 37.4 at 64 (by rows 49.3); level from 128 rows.
    if m >= ROW_SPLIT_ROWS:
        run_kernel("gemm_rows", words, m, threads)
    else:
        run_kernel("gemm_panels", words, panels.shape[0], threads)
    return out


ROW_SPLIT_ROWS = 128


def amx_panels_built() -> bool:
    """AMX's tiles run the panel GEMM here (gemm_amx.c: built with AMX, the OS grants the tiles)."""
    lib = library()
    return lib is not None and bool(lib.gemm_amx_available())


def amx_panels_take(panels: torch.Tensor) -> bool:
    """gemm_amx.c takes these panels: K (two per pair) a multiple of 32."""
    return panels.shape[1] * 2 % 32 == 0


def amx_panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                   threads: int = 1, silu_mul: bool = False) -> torch.Tensor:
    """panel_gemm's result on AMX's tiles (gemm_amx.c), from the same panels: for batches of
    more than a few rows, where the tiles are several times faster than AVX512-BF16."""
    m, k = x.shape
    out = x.new_empty(m, n // 2 if silu_mul else n)
    tiles = -(-m // 16)
    # x in AMX's A layout: [tiles of 16 rows][K/32][16][32], the last tile zero-padded
    a = x.new_zeros(tiles * 16, k) if m % 16 else x
    if m % 16:
        a[:m] = x
    a = a.reshape(tiles, 16, k // 32, 32).transpose(1, 2).contiguous()
    words = [a.data_ptr(), k, k, panels.data_ptr(),
             bias.data_ptr() if bias is not None else None, out.data_ptr(), out.shape[1], n, m,
             int(silu_mul)]
    run_kernel("gemm_amx", words, panels.shape[0], threads)
    return out
