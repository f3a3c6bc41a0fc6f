"""The kernel backend: which implementation serves each operation of the model (projections,
the MLP's gate/up with SiLU, attention, RMSNorm, RoPE, the KV write, the greedy argmax), chosen
once at load from the CPU's features, the dtypes and the KVFLOW_NO_* opt-outs. The model and
the runner call through the chosen `Kernels`; nothing below them re-checks the CPU or the
opt-outs (kernels still check the tensors they get: dtype, layout, shape).

What serves here, and why:

- projections: kvflow's bf16 panel GEMM where the CPU has AVX512-BF16 (faster than oneDNN on
  decode-sized batches, level on long prefills: packed_linear.py); where it also has AMX, the
  panels' AVX512-BF16 kernel serves only batches of up to AMX_PANEL_ROWS rows
  (AMX_PANEL_ROWS_LARGE for the LM head) and AMX's tiles the longer ones, reading the same
  panels (2-14x the AVX512-BF16 rate from 16 rows: packed_linear.amx_panel_rows; one copy of the
  weights, csrc/gemm_amx.c); else oneDNN's prepacked
  GEMM (fp32; bf16 only on CPUs with native bf16, elsewhere oneDNN emulates it), else F.linear;
  in fp32, batches of up to GEMV_MAX_ROWS rows take kvflow's fp32 GEMV (AVX-512 or AVX2:
  csrc/gemv_f32.c), which streams a decode step's weights faster than oneDNN, from fp32
  panels or, with `weight_dtype` bfloat16/float16, from half-precision ones (half the bytes);
  on AVX2 it serves every batch (a GEMM ahead of oneDNN's there) and oneDNN keeps no copy;
- the state layers' (short conv, Gated DeltaNet, Mamba2) causal conv and one-token state
  updates: csrc/state_update.c, and their prompt chunks' scans: csrc/state_scan.c (AVX-512,
  AVX2 or scalar, chosen once) where the kernels built, else PyTorch;
- attention, norm, RoPE, SiLU, KV write, argmax: the C kernels (kvflow/csrc) where they built,
  else PyTorch; attention's prompt kernel exists only where the CPU has AVX512-BF16, elsewhere
  prompt tokens run as rows of the decode kernel; a one-byte KV cache (`kv_cache_dtype` fp8 or
  int8) has its own decode kernel and writer (csrc/paged_attention_quant.c, its AVX-512, AVX2 or
  scalar path chosen once); the prompt kernel widens its tiles to bf16 as it gathers them.
  Attention's backend and the KV writer are kvflow/attention/selector.py's choice, made here
  once the KV cache's dtype is known (`with_kv_dtype` when the runner's cache differs).

On an NVIDIA GPU (device cuda) the set is gpu_kernels.py's: torch GEMMs in bf16, the Triton
paged attention of kvflow/model/triton and the state layers' Triton conv, state updates and
prompt scans (triton/state_update.py, triton/state_scan.py).

Quantized weights (kvflow/model/quant) are served by kvflow/csrc/gemm_quant.c (and, for 8-bit
weights at batch sizes, gemm_quant_wide.c) through the same `linear(x, w, packed)` seam: their
PackedWeight carries the quantized weight, and its instruction set (AVX-512 VNNI, AVX2 or
scalar) is chosen once at load from these features.

A new variant (sliding-window or soft-capped attention) is one more
implementation and one more branch in `select_kernels` (for attention, in
kvflow/attention/selector.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from kvflow import envs
from kvflow.attention.selector import select_attention
from kvflow.csrc import library, ops
from kvflow.csrc.gemv import GEMV_ALL_ROWS, GEMV_MAX_ROWS, best_gemv_isa
from kvflow.csrc.lora import best_lora_isa, lora_add, lora_add_torch
from kvflow.csrc.state_update import best_state_isa
from kvflow.model import packed_linear
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.csrc.gemm import amx_panels_built
from kvflow.model.packed_linear import AMX_PANEL_ROWS, AMX_PANEL_ROWS_LARGE


@dataclass(frozen=True)
class KernelOptions:
    """The user's opt-outs (KVFLOW_NO_KERNELS, KVFLOW_NO_ONEDNN, KVFLOW_NO_PANEL_GEMM,
    KVFLOW_NO_GEMV, KVFLOW_NO_AMX_ATTENTION, KVFLOW_NO_AMX_PANELS), a narrower fp32 GEMV path to measure
    (KVFLOW_GEMV_ISA), and the storage dtype of the GEMV's weights (the `weight_dtype` option:
    None is fp32; bf16 or fp16 are widened to fp32 in the kernel, model/weight_dtype.py)."""

    c_kernels: bool = True
    onednn: bool = True
    panel_gemm: bool = True
    gemv: bool = True
    amx_attention: bool = True
    amx_panels: bool = True  # False: oneDNN's AMX GEMM on its own copy (KVFLOW_NO_AMX_PANELS)
    gemv_isa: str | None = None  # None: the widest this CPU and build have
    gemv_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.gemv_isa not in (None, "avx2"):
            raise ValueError(f"KVFLOW_GEMV_ISA must be avx2 (or unset), got {self.gemv_isa!r}")
        if self.gemv_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"the GEMV stores weights in bf16 or fp16 (or fp32: None), not "
                             f"{self.gemv_dtype}")

    @classmethod
    def from_env(cls) -> "KernelOptions":
        return cls(c_kernels=not envs.KVFLOW_NO_KERNELS, onednn=not envs.KVFLOW_NO_ONEDNN,
                   panel_gemm=not envs.KVFLOW_NO_PANEL_GEMM, gemv=not envs.KVFLOW_NO_GEMV,
                   amx_attention=not envs.KVFLOW_NO_AMX_ATTENTION,
                   amx_panels=not envs.KVFLOW_NO_AMX_PANELS, gemv_isa=envs.KVFLOW_GEMV_ISA)


@dataclass(frozen=True)
class Kernels:
    """The implementations one model calls, and what they were chosen from.

    `pack(w, gate_up=False)` prepacks a projection's weight for `linear(x, w, packed, bias=None)`
    and `linear_silu_mul(x, w, packed)` (None: no packing here, F.linear serves). The others
    have the signatures of their PyTorch versions in kvflow/csrc/ops.py and kvflow/attention
    (torch_sdpa.py, kv_layout.write_rows)."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    device_type: str
    features: CpuFeatures
    options: KernelOptions
    names: dict[str, str]  # operation -> what serves it, for the start-up line
    pack: Callable[..., packed_linear.PackedWeight | None] | None
    linear: Callable[..., torch.Tensor]
    linear_silu_mul: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    # Gemma: RMSNorm times an fp32 weight (its 1 + w) rounded once; the GeGLU MLP
    add_rms_norm_fp32_weight: Callable[..., torch.Tensor]
    linear_gelu_tanh_mul: Callable[..., torch.Tensor]
    rope: Callable[..., None]
    write_kv: Callable[..., None]
    attention: Callable[..., torch.Tensor]
    argmax: Callable[[torch.Tensor], list[int]]
    # LoRA's batched shrink + expand into a projection's output: lora(y, x, projection's
    # slots, step) (model/lora.py's LoRAProjection and LoRAStep)
    lora: Callable[..., None] | None = None
    lora_name: str = "torch"  # what serves it, for the start-up line's LoRA part
    # the state layers' conv and one-token state updates (csrc/state_update.py): the C path's
    # instruction set, None for their PyTorch paths
    state_isa: str | None = None
    # on an NVIDIA GPU: the state layers' conv, one-token updates and prompt-chunk scans in
    # Triton (kvflow/model/triton/state_scan.py's `ops()`, imported with the GPU set); None elsewhere
    state_triton: object | None = None

    def norm_linear(self, x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, w: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
        """linear(add_rms_norm(x, delta, norm_weight, eps), w, packed, bias), fused where the
        weight is quantized (packed_linear.norm_linear)."""
        return packed_linear.norm_linear(x, delta, norm_weight, eps, w, packed, bias,
                                         add_rms_norm=self.add_rms_norm, linear=self.linear)

    def norm_linear_silu_mul(self, x: torch.Tensor, delta: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, w: torch.Tensor, packed) -> torch.Tensor:
        """linear_silu_mul(add_rms_norm(x, delta, norm_weight, eps), w, packed), likewise."""
        return packed_linear.norm_linear(x, delta, norm_weight, eps, w, packed, None,
                                         add_rms_norm=self.add_rms_norm,
                                         linear=self.linear_silu_mul, silu_mul=self.silu_mul)

    def describe(self) -> str:
        """One line for the start-up report: `kernels [avx512-bf16]: linear=panel-bf16, ...`."""
        where = self.features.isa if self.device_type == "cpu" else self.device_type
        return f"kernels [{where}]: " + ", ".join(f"{op}={name}" for op, name in self.names.items())

    def with_kv_dtype(self, kv_dtype: torch.dtype) -> "Kernels":
        """The same choice for a KV cache of `kv_dtype` (the runner's, when it differs): its
        attention and KV write; the projections stay as they were packed at load."""
        if kv_dtype == self.kv_dtype:
            return self
        new = select_kernels(self.dtype, kv_dtype, self.device_type, self.features, self.options)
        return replace(self, kv_dtype=kv_dtype, attention=new.attention, write_kv=new.write_kv,
                       names={**self.names, "attention": new.names["attention"],
                              "kv_write": new.names["kv_write"]})


def _gemv_isa(features: CpuFeatures, options: KernelOptions) -> str | None:
    """The fp32 GEMV's path here: the widest vector one, or AVX2 where options force it (and
    the CPU has a vector path); None: no GEMV."""
    best = best_gemv_isa(features) if options.gemv else None
    return best if best is None or options.gemv_isa is None else options.gemv_isa


def _lora_c(y, x, proj, step, *, isa: str) -> None:
    lora_add(y, x, proj.a, proj.bt, proj.ranks, proj.starts, step.slots, isa,
             torch.get_num_threads())


def _lora_torch(y, x, proj, step) -> None:
    lora_add_torch(y, x, proj.a, proj.bt, proj.ranks, proj.starts, step.slots)


def select_kernels(dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None, features: CpuFeatures | None = None,
                   options: KernelOptions | None = None) -> Kernels:
    """Choose the implementations for a model in `dtype` with a `kv_dtype` KV cache on
    `device` (None: the CPU); `features` default to this CPU's, `options` to the environment's."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    device_type = "cpu" if device is None else torch.device(device).type
    features = cpu_features() if features is None else features
    options = KernelOptions.from_env() if options is None else options
    if device_type == "cuda":  # Triton attention, torch GEMMs (gpu_kernels.py; imports triton)
        from kvflow.model.gpu_kernels import gpu_implementations
        names, impl = gpu_implementations()
        return Kernels(dtype=dtype, kv_dtype=kv_dtype, device_type=device_type, features=features,
                       options=options, names=names, pack=None,
                       add_rms_norm_fp32_weight=ops.add_rms_norm_fp32_weight_torch,
                       linear_gelu_tanh_mul=partial(packed_linear.linear_silu_mul,
                                                    silu_mul=ops.gelu_tanh_mul_torch), **impl)
    on_cpu = device_type == "cpu"
    lib = library() if on_cpu and options.c_kernels else None
    c = lib is not None
    bf16 = torch.bfloat16

    # projections
    panels = (c and options.panel_gemm and dtype == bf16 and features.avx512_bf16
              and bool(lib.gemm_bf16_available()))
    onednn = (on_cpu and options.onednn and packed_linear.onednn_available()
              and (dtype == torch.float32 or (dtype == bf16 and features.native_bf16
                                              and packed_linear.onednn_bf16_available())))
    gemv_isa = _gemv_isa(features, options) if c and dtype == torch.float32 else None
    gemv_all = gemv_isa is not None and GEMV_MAX_ROWS.get(gemv_isa, 0) >= GEMV_ALL_ROWS
    onednn = onednn and not gemv_all  # the GEMV serves every batch: no second copy
    silu_mul = ops.silu_mul if c else ops.silu_mul_torch
    # AMX's tiles over the panels (gemm_amx.c), else oneDNN's AMX GEMM on a copy of its own
    tiles = panels and features.amx_bf16 and options.amx_panels and amx_panels_built()
    amx = panels and features.amx_bf16 and (tiles or onednn)
    amx_name = "amx-panels" if tiles else "onednn-amx"
    # rows past these: AMX (the larger for weights over AMX_LARGE_BYTES)
    amx_rows = f"<={AMX_PANEL_ROWS},{AMX_PANEL_ROWS_LARGE}" if amx else ""
    linear_name = "panel-bf16" if panels else "onednn" if onednn else "torch"
    if amx:
        linear_name = f"panel-bf16{amx_rows}+{amx_name}"
    gemv_dtype = options.gemv_dtype if gemv_isa is not None else None
    if gemv_isa is not None:  # decode-sized batches: the GEMV; longer ones as above
        stored = {torch.bfloat16: "-bf16", torch.float16: "-fp16"}.get(gemv_dtype, "")
        linear_name = f"gemv-{gemv_isa}{stored}" + ("" if gemv_all else f"+{linear_name}")
    # attention and the KV write: their backend and entry points for this cache (selector.py)
    attn = select_attention(dtype, kv_dtype, features, c_kernels=c,
                            amx_attention=options.amx_attention)
    c_name = "c" if c else "torch"
    names = {"linear": linear_name,
             "gate_up": ((f"panel-bf16-silu{amx_rows}+amx-panels-silu" if tiles
                          else f"panel-bf16-silu{amx_rows}+onednn-amx+{c_name}-silu") if amx
                         else "panel-bf16-silu" if panels else f"{linear_name}+{c_name}-silu"),
             "attention": attn.name, "norm": c_name, "rope": c_name, "kv_write": attn.write_name,
             "argmax": "c" if c and dtype == bf16 else "torch"}
    lora_isa = best_lora_isa(features) if c else None
    state_isa = best_state_isa(features) if c else None
    names["state"] = f"c-{state_isa}" if state_isa else "torch"
    pack = (partial(packed_linear.pack_weight, panels=panels, onednn=onednn, gemv_isa=gemv_isa,
                    gemv_rows=GEMV_MAX_ROWS.get(gemv_isa, 0), gemv_dtype=gemv_dtype,
                    amx=amx, amx_tiles=tiles)
            if panels or onednn or gemv_isa else None)
    return Kernels(
        dtype=dtype, kv_dtype=kv_dtype, device_type=device_type, features=features,
        options=options, names=names, pack=pack,
        linear=packed_linear.linear,
        linear_silu_mul=partial(packed_linear.linear_silu_mul, silu_mul=silu_mul),
        silu_mul=silu_mul,
        add_rms_norm=ops.add_rms_norm if c else ops.add_rms_norm_torch,
        add_rms_norm_fp32_weight=ops.add_rms_norm_fp32_weight if c else ops.add_rms_norm_fp32_weight_torch,
        linear_gelu_tanh_mul=partial(packed_linear.linear_silu_mul, silu_mul=ops.gelu_tanh_mul_torch),
        rope=ops.rope_ if c else ops.rope_torch_,
        write_kv=attn.write_kv,
        attention=attn.attention,
        argmax=ops.argmax_rows if c else ops.argmax_rows_torch,
        lora=partial(_lora_c, isa=lora_isa) if lora_isa else _lora_torch,
        lora_name=f"c-{lora_isa}" if lora_isa else "torch",
        state_isa=state_isa,
    )

