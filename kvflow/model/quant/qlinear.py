"""x @ w.T for a quantized weight. Few rows (decode): the activations are quantized to int8 (per
block of 32, or per row for int8 W8A8), then kvflow/csrc/gemm_quant.c multiplies them with the
packed weight, both split over the kernel pool. 8-bit weights with bf16 activations on
AVX512-BF16, from WIDE_ROWS rows (prefill, batches): kvflow/csrc/gemm_quant_wide.c widens them to
bf16 per thread, once per call, and multiplies the activations at the bf16 GEMM's speed."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.csrc import library, run_kernel
from kvflow.model.quant.packing import BLOCK, PANEL

ISA_CODES = {"scalar": 0, "avx2": 1, "avx512-vnni": 2}
# the C kernels' kinds (kernels.h): q4, q4s and q8 in gemm_quant.c, MXFP4 in gemm_mxfp4.c, q6
# (GGUF Q6_K) in gemm_q6.c, q4k (GGUF Q4_K) in gemm_q4k.c
KIND_CODES = {"q4": 0, "q8": 1, "mxfp4": 2, "q4s": 3, "q6": 4, "q4k": 5, "parts": 6}
# Rows from which 8-bit weights are widened to bf16 (benchmarks/README.md, "The quantized linear
# at batch sizes" and "8-bit weights at decode-sized batches", Zen 4, one thread): the int8 GEMM of 8-bit weights runs 25-30% behind the bf16 GEMM from
# ~100 rows (its records are twice a 4-bit one's) and the widened path within 5% of it; level at
# 48-64 rows, the LM head's shape included. 4-bit weights' int8 GEMM is level with bf16 or ahead
# at every row count: never widened. Nor is any weight where the widened path would be the
# fp32-FMA one (AVX2, fp32 activations, odd K): the int8 GEMM ran 1.5-3.7x faster than it at
# 8-512 rows.
# Per-row activation scales (int8 W8A8) take the same threshold: their row maximum is found in
# vector code like the per-block ones (it was scalar, and then widening from 16-32 rows paid).
# 6-bit weights (Q6_K as stored, which were requantized to 8 bits before) take the same
# threshold, on the bf16 path only, so a Q4_K_M file's prefill runs its Q6_K tensors as it did:
# widened, q6 and q8 records alike cost 21.9 and 21.6 ms at 64 rows of 2048x8192 (one thread,
# Sapphire Rapids, CPU time). There the int8 GEMM was the faster one at 16-128 rows for both
# (q6 11.4 ms, q8 8.1 at 64 rows): a threshold per CPU kind is still to be measured.
# MXFP4 (gpt-oss's experts) is never widened: one expert's gate_up (5760 x 2880) ran ahead of the
# bf16 panel GEMM at every row count from 1 to 256 (0.36 vs 2.13 ms at 1 row, 8.4 vs 10.5 at 64,
# 33.9 vs 39.0 at 256; one thread, Zen 4).
WIDE_ROWS = {"q8": 64, "q6": 64}
NEVER = 1 << 62


def widen_from(kind: str, k: int, isa: str, bf16: bool) -> int:
    """The rows from which quant_linear widens such a weight (NEVER: it does not)."""
    if kind not in WIDE_ROWS or not bf16 or isa != "avx512-vnni" or k % 2:
        return NEVER
    return WIDE_ROWS[kind]


@dataclass
class QuantizedWeight:
    """One (n, k) projection in the panel layout (packing.py). `source` names where it came
    from (a GGUF type like Q4_1, or int8), `per_row`: quantize activations per row (W8A8)."""

    kind: str  # q4 | q4s | q4k | q8 | q6 | mxfp4 | parts
    n: int
    k: int
    packed: torch.Tensor  # uint8
    isa: str
    source: str
    per_row: bool = False
    wide_rows: int = field(init=False, repr=False)  # with bf16 activations (widen_from)

    def __post_init__(self) -> None:
        self.wide_rows = widen_from(self.kind, self.k, self.isa, True)

    @property
    def kb(self) -> int:
        return -(-self.k // BLOCK)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def available_isas() -> list[str]:
    """The paths the kernel library was built with, narrowest first."""
    lib = library()
    if lib is None:
        return []
    bits = int(lib.gemm_quant_isas())
    return [name for name, code in ISA_CODES.items() if bits >> code & 1]


def best_isa(features) -> str:
    """The widest path that both the build and the CPU offer."""
    built = available_isas()
    if "avx512-vnni" in built and {"avx512_vnni", "avx512bw", "avx512vl"} <= features.flags:
        return "avx512-vnni"
    if "avx2" in built and {"avx2", "fma", "f16c"} <= features.flags:
        return "avx2"
    return "scalar"


def quantize_activations(x: torch.Tensor, kb: int, per_row: bool, threads: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 or fp32) -> (qx int8 [M, kb*32], dx [M, kb], dx * sum(qx) [M, kb])."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    qx = torch.empty(m, kb * BLOCK, dtype=torch.int8)
    dx = torch.empty(m, kb, dtype=torch.float32)
    dxs = torch.empty(m, kb, dtype=torch.float32)
    words = [x.data_ptr(), x.stride(0), k, kb, int(x.dtype == torch.bfloat16), int(per_row),
             qx.data_ptr(), dx.data_ptr(), dxs.data_ptr()]
    run_kernel("quantize_q8", words, m, threads if m >= 4 * threads else 1)
    return qx, dx, dxs


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                 threads: int | None = None, isa: str | None = None,
                 wide_rows: int | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype (bf16, else fp32): one C call
    (pool.c's quant_linear) over the kernel pool: from `wide_rows` rows (default: widen_from's
    for the weight, the activations' dtype and the ISA) the widened float GEMM where the ISA has
    one, else the rows quantized to int8 and the int8 GEMM. `silu_mul`: w is an MLP's [gate; up]
    and the result is silu(gate) * up [M, N/2], in the same call.

    Kept lean: a decode step of the default model makes 121 of these calls, and at one row
    each costs about as much in Python as in the kernel."""
    if x.dtype is not torch.bfloat16 and x.dtype is not torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert k == w.k, (x.shape, w.k)
    out = torch.empty(m, w.n // 2 if silu_mul else w.n, dtype=x.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    bf16 = int(x.dtype is torch.bfloat16)
    if wide_rows is None:
        wide_rows = (w.wide_rows if isa is None else widen_from(w.kind, k, isa, True)) \
            if bf16 else NEVER
    rc = _lib().quant_linear(x.data_ptr(), x.stride(0), k, w.kb, bf16, int(w.per_row),
                             w.packed.data_ptr(), KIND_CODES[w.kind], ISA_CODES[isa or w.isa],
                             None if bias is None else bias.data_ptr(), out.data_ptr(), w.n, bf16,
                             m, torch.get_num_threads() if threads is None else threads, wide_rows,
                             int(silu_mul))
    if rc != 0:
        raise MemoryError("quant_linear: no memory for its scratch")
    return out


def norm_quant_linear(residual: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, w: QuantizedWeight, bias: torch.Tensor | None = None,
                      silu_mul: bool = False) -> torch.Tensor:
    """quant_linear(ops.add_rms_norm(residual, delta, norm_weight, eps), w, bias, silu_mul=...)
    in one C call, with the same numbers: residual += delta in place, the normed rows only in
    the kernel's scratch. The caller checks that the C norm takes these tensors (one dtype,
    bf16 or fp32, contiguous; ops.add_rms_norm's condition)."""
    m, k = residual.shape
    assert k == w.k, (residual.shape, w.k)
    out = torch.empty(m, w.n // 2 if silu_mul else w.n, dtype=residual.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    bf16 = int(residual.dtype is torch.bfloat16)
    rc = _lib().quant_linear_normed(
        residual.data_ptr(), None if delta is None else delta.data_ptr(), norm_weight.data_ptr(), eps,
        k, w.kb, bf16, int(w.per_row), w.packed.data_ptr(), KIND_CODES[w.kind], ISA_CODES[w.isa],
        None if bias is None else bias.data_ptr(), out.data_ptr(), w.n, bf16, m,
        torch.get_num_threads(), w.wide_rows if bf16 else NEVER, int(silu_mul))
    if rc != 0:
        raise MemoryError("quant_linear: no memory for its scratch")
    return out


_LIB = []


def _lib():
    if not _LIB:
        _LIB.append(library())
    return _LIB[0]
