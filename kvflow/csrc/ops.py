"""Tensor-level entry points of the fused C kernels (fp32 and bf16), each beside its PyTorch
equivalent. Numerics as in HF's Llama. kvflow/model/kernels.py chooses one set at load; a C
entry point still hands a tensor the kernels do not take (another dtype, a strided view, mixed
dtypes) to its PyTorch twin, so either set serves any input."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.csrc import library, run_kernel

# Below this many values an elementwise kernel takes a few microseconds, about what handing
# rows to a pool thread costs.
MIN_PARALLEL_VALUES = 1 << 13


def _threads(values: int) -> int:
    return torch.get_num_threads() if values >= MIN_PARALLEL_VALUES else 1


def _kernel_suffix(*tensors: torch.Tensor) -> str | None:
    """Which kernel variant takes these tensors: "f32" or "bf16" when all are contiguous CPU
    tensors of that one dtype; None: the PyTorch path."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtypes.pop())


# -- PyTorch ---------------------------------------------------------------------------------
def add_rms_norm_torch(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """residual += delta (in place, if given); return RMSNorm(residual) * weight."""
    if delta is not None:
        residual.add_(delta)
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(residual.dtype)


def rope_torch_(qkv: torch.Tensor, n_heads: int, head_dim: int, positions: np.ndarray,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `n_heads` heads of each row of qkv [T, width] in place (HF rotate_half
    RoPE); cos/sin are the [max_pos, head_dim] fp32 tables, positions int64 [T]."""
    x = qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)
    idx = torch.from_numpy(positions)
    c, s = cos[idx].to(qkv.dtype).unsqueeze(1), sin[idx].to(qkv.dtype).unsqueeze(1)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * c + rotated * s)


def add_rms_norm_fp32_weight_torch(residual: torch.Tensor, delta: torch.Tensor | None,
                                   weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place, if given); return RMSNorm(residual) * weight with an fp32
    `weight`, multiplied in fp32 and rounded once (Gemma's norm, whose weight is 1 + w)."""
    if delta is not None:
        residual.add_(delta)
    xf = residual.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(residual.dtype)


def gelu_tanh_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] along the last dim (GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows_torch(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest logit (first on ties), for greedy sampling."""
    return logits.float().argmax(dim=-1).tolist()


# -- C kernels -------------------------------------------------------------------------------
def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """add_rms_norm_torch through the C kernel."""
    suffix = _kernel_suffix(residual, weight, *([delta] if delta is not None else []))
    if suffix is None:
        return add_rms_norm_torch(residual, delta, weight, eps)
    out = torch.empty_like(residual)
    n = residual.shape[-1]
    rows = residual.numel() // n
    run_kernel(f"add_rms_norm_{suffix}", [residual.data_ptr(), delta.data_ptr() if delta is not None
                                          else None, weight.data_ptr(), out.data_ptr(), n],
               rows, _threads(rows * n), farg=eps)
    return out


def c_norm_takes(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """add_rms_norm's C kernel takes these tensors (else it hands them to PyTorch)."""
    return _kernel_suffix(residual, weight, *([delta] if delta is not None else [])) is not None


def add_rms_norm_fp32_weight(residual: torch.Tensor, delta: torch.Tensor | None,
                             weight: torch.Tensor, eps: float) -> torch.Tensor:
    """add_rms_norm_fp32_weight_torch; for fp32 activations that is exactly add_rms_norm, so
    the C kernel serves it."""
    if residual.dtype == torch.float32:
        return add_rms_norm(residual, delta, weight, eps)
    return add_rms_norm_fp32_weight_torch(residual, delta, weight, eps)


def rope_(qkv: torch.Tensor, n_heads: int, head_dim: int, positions: np.ndarray,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """rope_torch_ through the C kernel."""
    t = qkv.shape[0]
    suffix = _kernel_suffix(qkv)
    if not (suffix and _kernel_suffix(cos, sin) == "f32" and positions.dtype == np.int64
            and positions.flags.c_contiguous):
        rope_torch_(qkv, n_heads, head_dim, positions, cos, sin)
        return
    run_kernel(f"rope_{suffix}", [qkv.data_ptr(), qkv.stride(0), positions.ctypes.data,
                                  cos.data_ptr(), sin.data_ptr(), n_heads, head_dim],
               t, _threads(t * n_heads * head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul_torch through the C kernel."""
    suffix = _kernel_suffix(gate_up)
    if suffix is None:
        return silu_mul_torch(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    run_kernel(f"silu_mul_{suffix}", [gate_up.data_ptr(), out.data_ptr(), n], t, _threads(t * n))
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """argmax_rows_torch, with bf16 logits read in place instead of through an fp32 copy."""
    if logits.dtype != torch.bfloat16 or _kernel_suffix(logits) != "bf16":
        return argmax_rows_torch(logits)
    rows, n = logits.shape
    out = np.empty(rows, dtype=np.int64)
    library().argmax_rows_bf16(logits.data_ptr(), n, out.ctypes.data, 0, rows, n)
    return out.tolist()
