"""The kernel set on an NVIDIA GPU (model/kernels.py's select_kernels picks it for device
cuda): projections through torch (cuBLAS, bf16); attention, the KV write, RMSNorm with the
residual add, RoPE and SiLU-mul through the Triton kernels of kvflow/model/triton; the state
layers' conv, one-token updates and prompt-chunk scans too; the greedy argmax in
PyTorch on the device. triton is imported here, and only when this set is built."""
from __future__ import annotations

from functools import partial

from kvflow.csrc import ops
from kvflow.model import packed_linear


def gpu_implementations() -> tuple[dict[str, str], dict]:
    """(names for the start-up line, the `Kernels` fields that hold implementations) on an
    NVIDIA GPU. On a CPU the same set runs only under Triton's interpreter, for tests."""
    from kvflow.model.triton import fused_ops, state_scan
    from kvflow.model.triton.attention import attention_with_triton
    from kvflow.model.triton.kv_write import write_kv
    from kvflow.model.triton.lora import lora_add

    names = {"linear": "torch", "gate_up": "torch+triton-silu", "attention": "triton-paged",
             "norm": "triton", "rope": "triton", "kv_write": "triton", "argmax": "torch", "state": "triton"}
    return names, dict(
        linear=packed_linear.linear,
        linear_silu_mul=partial(packed_linear.linear_silu_mul, silu_mul=fused_ops.silu_mul),
        silu_mul=fused_ops.silu_mul,
        add_rms_norm=fused_ops.add_rms_norm,
        rope=fused_ops.rope_,
        write_kv=write_kv,
        attention=attention_with_triton,
        argmax=ops.argmax_rows_torch,
        lora=lambda y, x, p, step: lora_add(y, x, p.a, p.bt, p.ranks, p.starts, step.slots, p.bounds),
        lora_name="triton",
        state_triton=state_scan.ops(),
    )
