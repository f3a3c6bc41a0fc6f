"""The kernel set on an NVIDIA GPU (model/kernels.py's select_kernels picks it for device
cuda): projections through torch (cuBLAS, bf16), attention and the KV write through the Triton
kernels of kvflow/model/triton, RMSNorm/RoPE/SiLU and the argmax in PyTorch on the device.
triton is imported here, and only when this set is built."""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from kvflow.csrc import ops
from kvflow.model import packed_linear


def rope_on_device_(qkv: torch.Tensor, n_heads: int, head_dim: int,
                    positions: torch.Tensor | np.ndarray, cos: torch.Tensor,
                    sin: torch.Tensor) -> None:
    """ops.rope_torch_ with positions already on the device (a CUDA graph's buffer), or host
    positions copied there."""
    if isinstance(positions, np.ndarray):
        positions = torch.from_numpy(positions).to(qkv.device, non_blocking=True)
    x = qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)
    c, s = cos[positions].to(qkv.dtype).unsqueeze(1), sin[positions].to(qkv.dtype).unsqueeze(1)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * c + rotated * s)


def gpu_implementations() -> tuple[dict[str, str], dict]:
    """(names for the start-up line, the `Kernels` fields that hold implementations) on an
    NVIDIA GPU. On a CPU the same set runs only under Triton's interpreter, for tests."""
    from kvflow.model.triton.attention import attention_with_triton
    from kvflow.model.triton.kv_write import write_kv

    names = {"linear": "torch", "gate_up": "torch+torch-silu", "attention": "triton-paged",
             "norm": "torch", "rope": "torch", "kv_write": "triton", "argmax": "torch"}
    return names, dict(
        linear=packed_linear.linear,
        linear_silu_mul=partial(packed_linear.linear_silu_mul, silu_mul=ops.silu_mul_torch),
        silu_mul=ops.silu_mul_torch,
        add_rms_norm=ops.add_rms_norm_torch,
        rope=rope_on_device_,
        write_kv=write_kv,
        attention=attention_with_triton,
        argmax=ops.argmax_rows_torch,
    )
