"""A decode step's decoder layers in one C call (kvflow/csrc/decode_step.c), the way a CUDA
graph replays a step: at batch 1 the ~7 kernels of each layer cost ~10-17 us of Python each
around them (torch.empty, ctypes), 30 layers over, about what the projections cost. The words
the C side reads are built once per model (the layers') and per step (rows, buffers, the
attention metadata); the numbers are the per-layer path's, bit for bit (the same kernels in
the same order with the same splits).

Which models: Llama-family dense layers on the CPU with every projection quantized
(kvflow/model/quant), or with fp32 activations on the fp32 GEMV (csrc/gemv_f32.c, its
panels in fp32, bf16 or fp16), or with bf16 ones on the bf16 panel GEMM (csrc/gemm_bf16.c),
served by the C kernels, without QK-norm, partial RoPE, experts or
tensor parallelism; bf16 or fp32 activations with a KV cache the C writer takes (the
activations' dtype, bf16 under fp32 ones, or a one-byte fp8 / int8 cache, written and read by
paged_attention_quant.c on the path and with the scales the per-layer path uses). Which steps:
decode-only (a speculative verification step is one: the runner makes each checked token a
decode row, kvflow/attention's build_attention_metadata's queries_as_decodes) with up to MAX_ROWS rows (where the quantized projections fuse their norm and
SiLU: packed_linear.FUSED_ROWS), and with the GEMV no more than its rows (GEMV_MAX_ROWS: above
them oneDNN serves, from Python). Everything else takes the per-layer path, as does every step
under KVFLOW_NO_DECODE_GRAPH=1. The embedding, the final norm and the LM head stay as they are.

Each projection runs as the per-layer path runs it: the norm kernel into a scratch row block
(where quant_linear_normed puts it too), the GEMM, then for gate_up the SiLU * up kernel where
the GEMM does not fuse it (the GEMV; the panels where gate and up do not come in whole panels)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow import envs
from kvflow.attention.c_kernels import Q8_ISAS, CAttention, float_bits
from kvflow.attention.kv_layout import FP8
from kvflow.attention.kv_write import CKVWriter
from kvflow.attention.selector import best_q8_isa
from kvflow.csrc import library, ops
from kvflow.csrc.gemv import GEMV_ISAS, GEMV_WEIGHT_DTYPES
from kvflow.model.cpu_features import cpu_features
from kvflow.model.packed_linear import FUSED_ROWS, PackedWeight
from kvflow.model.quant.qlinear import ISA_CODES, KIND_CODES, NEVER
from kvflow.models.registry import family_of

logger = logging.getLogger("kvflow")

MAX_ROWS = FUSED_ROWS
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# decode_step.c's records, in its order
PROJ_WORDS = ("packed", "kind", "isa", "per_row", "n", "k", "kb", "wide_rows", "gemm")
GEMM_QUANT, GEMM_GEMV_F32, GEMM_PANELS_BF16 = 0, 1, 2  # decode_step.c's `gemm` codes
LAYER_HEAD = ("in_norm", "post_norm", "eps", "scale", "qkv_bias", "k_cache", "v_cache", "k_scale",
              "v_scale", "heads", "kv_heads", "head_dim", "qk_scale")
LAYER_WORDS = len(LAYER_HEAD) + len(PROJECTIONS) * len(PROJ_WORDS)
STEP_WORDS = ("m", "x", "x_bf16", "kv_dtype", "threads", "positions", "cos", "sin", "qkv", "attn",
              "o", "act", "down", "groups", "layer_group", "normed", "gate_up", "q8_isa",
              "attn_io")
# decode_step.c's KV_* codes (the `kv_dtype` word)
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, FP8: 3}
GROUP_WORDS = ("slots", "tables", "bt_stride", "seq_lens", "rows", "block_size", "window")
_K_CACHE = LAYER_HEAD.index("k_cache")
_K_SCALE = LAYER_HEAD.index("k_scale")


def _double_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float64).view(np.int64)[0])


def _projection_words(p: PackedWeight, n: int, k: int, bf16: bool) -> list[int]:
    """A quantized weight: quant_linear's words, with the rows from which it widens as
    qlinear.py passes them; the bf16 panel GEMM's (its panels, whether SiLU * up is fused);
    else the GEMV's (its panels, storage and instruction set codes)."""
    w = p.quant
    if w is None and p.panels is not None:
        return [p.panels.data_ptr(), int(p.gate_up), 0, 0, n, k, 0, 0, GEMM_PANELS_BF16]
    if w is None:
        return [p.gemv.data_ptr(), GEMV_WEIGHT_DTYPES[p.gemv.dtype], GEMV_ISAS[p.gemv_isa], 0, n, k,
                0, 0, GEMM_GEMV_F32]
    return [w.packed.data_ptr(), KIND_CODES[w.kind], ISA_CODES[w.isa], int(w.per_row), w.n, w.k,
            w.kb, w.wide_rows if bf16 else NEVER, GEMM_QUANT]


def _on_gemv(p: PackedWeight | None, model) -> bool:
    """packed_linear.linear serves `p` with the fp32 GEMV at decode rows (up to p.gemv_rows)."""
    return (p is not None and p.quant is None and p.gemv is not None and not p.gate_up
            and p.panels is None and p.gemv_rows > 0 and model.dtype == torch.float32)


def _on_panels(p: PackedWeight | None, model) -> bool:
    """packed_linear.linear (or linear_silu_mul) serves `p` with the bf16 panel GEMM, split by
    panels at decode rows (MAX_ROWS is under gemm.ROW_SPLIT_ROWS)."""
    return (p is not None and p.quant is None and p.panels is not None
            and model.dtype == torch.bfloat16)


def _q8_isa(kernels) -> str:
    """The one-byte-cache decode path of these kernels' CAttention (bound at load; for another
    cache, the widest this CPU has: the C side reads it for one-byte caches only)."""
    return kernels.attention.q8_isa or best_q8_isa(cpu_features(), kernels.kv_dtype)


def max_rows(model) -> int:
    """The most rows of a step the graph takes for `model` (one why_not passed): MAX_ROWS, or the
    GEMV's rows where a projection is on it, or the panels' where oneDNN's AMX GEMM takes
    longer batches (packed_linear.AMX_PANEL_ROWS)."""
    packs = [layer.packed[name] for layer in model.layers for name in PROJECTIONS]
    rows = [p.gemv_rows for p in packs if p.gemv is not None and p.quant is None]
    rows += [p.panel_rows for p in packs if p.panels is not None and p.panel_rows is not None]
    return min([MAX_ROWS, *rows])


def why_not(model) -> str | None:
    """Why `model` (a LlamaForCausalLM, whose layers are LlamaDecoderLayers) cannot take its
    decode steps in one call; None: it can."""
    k = model.kernels
    if envs.KVFLOW_NO_DECODE_GRAPH:
        return "KVFLOW_NO_DECODE_GRAPH=1"
    if not family_of(model.arch.architecture).supports.decode_step:
        return f"{model.arch.architecture} declares no one-call step"
    if model.tp is not None or k.device_type != "cpu" or model.rope_cos.device.type != "cpu":
        return "not a one-rank CPU model"
    if model.dtype not in (torch.bfloat16, torch.float32):
        return f"activations in {model.dtype}"
    lib = library()
    if lib is None or k.add_rms_norm is not ops.add_rms_norm or k.rope is not ops.rope_ \
            or k.silu_mul is not ops.silu_mul or not isinstance(k.write_kv, CKVWriter) \
            or not isinstance(k.attention, CAttention):
        return "not every operation is a C kernel"
    for layer in model.layers:
        if layer.moe is not None or layer.q_norm is not None or layer.partial_rope:
            return "a layer with experts, QK-norm or partial RoPE"
        if layer.attn.sinks is not None:  # decode_step.c takes no sinks
            return "a layer with attention sinks"
        for name in PROJECTIONS:
            p = layer.packed.get(name)
            if p is None or (p.quant is None and not _on_gemv(p, model) and not _on_panels(p, model)):
                return f"{name} is neither quantized nor on the fp32 GEMV or the bf16 panels"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.dtype != model.dtype or not norm.is_contiguous():
                return "a norm weight the C norm does not take"
    if ops._kernel_suffix(model.rope_cos, model.rope_sin) != "f32":
        return "RoPE tables the C kernel does not take"
    return None


@dataclass
class DecodeGraph:
    """The layer records of one model and the per-step words; `run` takes a step or declines."""

    model: object
    kernels: object  # the model's Kernels when this was built: another set rebuilds it
    layers: np.ndarray  # [L, LAYER_WORDS] int64, the caches' pointers filled per cache list
    biases: list  # the qkv biases the records point at (kept alive here)
    max_rows: int  # the most rows a step may have here (max_rows(model))
    q8_isa: int  # paged_decode_q8's path for a one-byte cache: the per-layer path's (Q8_ISAS)
    attn_io: int  # paged_decode_bf16's io bits past bf16 q/out (4: prefetch every block, as per layer)
    step: np.ndarray = field(default_factory=lambda: np.zeros(len(STEP_WORDS), dtype=np.int64))
    scratch: dict = field(default_factory=dict)  # rows -> (qkv, attn, o, act, down, normed, gate_up)
    caches: list | None = None  # the cache list whose pointers `layers` holds
    cache_ptr: int = 0

    @classmethod
    def build(cls, model) -> "DecodeGraph | None":
        """The graph for `model`, or None (the reason logged at debug level)."""
        reason = why_not(model)
        if reason is not None:
            logger.debug("kvflow: decode steps layer by layer: %s", reason)
            return None
        lib = library()
        sizes = [len(PROJ_WORDS), LAYER_WORDS, len(STEP_WORDS), len(GROUP_WORDS)]
        assert [lib.decode_step_layout(i) for i in range(4)] == sizes, "decode_step.c's records moved"
        rows, biases = [], []
        for layer in model.layers:
            bias = layer.qkv_bias
            if bias is not None:  # fp32 for quant_linear and the GEMV; the panels' own (bf16)
                bias = bias.detach().contiguous()
                bias = bias if layer.packed["qkv_proj"].panels is not None else bias.float()
            biases.append(bias)
            a = layer.attn
            words = [layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr(),
                     _double_bits(layer.eps), _double_bits(a.scale),
                     0 if bias is None else bias.data_ptr(), 0, 0, 0, 0, a.num_heads,
                     a.num_kv_heads, a.head_dim,
                     0 if a.qk_scale is None else a.qk_scale.data_ptr()]
            for name in PROJECTIONS:
                n, k = getattr(layer, name).shape
                words += _projection_words(layer.packed[name], n, k, model.dtype == torch.bfloat16)
            rows.append(words)
        return cls(model, model.kernels, np.array(rows, dtype=np.int64), biases, max_rows(model),
                   Q8_ISAS[_q8_isa(model.kernels)],
                   4 if model.kernels.attention.prefetch_all else 0)

    def _caches_taken(self, kv_caches: list) -> bool:
        """Fill in the caches' pointers (once per cache list); False: caches the C writer and
        decode kernel do not take with these activations."""
        if kv_caches is self.caches and kv_caches[0][0].data_ptr() == self.cache_ptr:
            return True
        if len(kv_caches) != len(self.layers):
            return False
        kv_dtype = kv_caches[0][0].dtype
        # a float cache of another dtype than bf16 activations goes through kv_layout.write_rows
        if kv_dtype not in KV_DTYPES or (self.model.dtype == torch.bfloat16
                                         and kv_dtype == torch.float32):
            return False
        for i, (kc, vc) in enumerate(kv_caches):
            if kc.dtype != kv_dtype or vc.dtype != kv_dtype or kc.device.type != "cpu" \
                    or not (kc.is_contiguous() and vc.is_contiguous()):
                return False
            self.layers[i, _K_CACHE:_K_CACHE + 2] = (kc.data_ptr(), vc.data_ptr())
            # fp8's per-tensor scales, the layer's, as the per-layer path passes them
            self.layers[i, _K_SCALE:_K_SCALE + 2] = [float_bits(x)
                                                     for x in self.model.layers[i].attn.kv_scales]
        self.caches, self.cache_ptr = kv_caches, kv_caches[0][0].data_ptr()
        return True

    def _buffers(self, m: int) -> tuple[torch.Tensor, ...]:
        bufs = self.scratch.get(m)
        if bufs is None:
            first = self.model.layers[0]
            n = {name: getattr(first, name).shape[0] for name in PROJECTIONS}
            widths = (n["qkv_proj"], first.attn.q_size, n["o_proj"], n["gate_up_proj"] // 2,
                      n["down_proj"], first.qkv_proj.shape[1], n["gate_up_proj"])
            bufs = self.scratch[m] = tuple(torch.empty(m, w, dtype=self.model.dtype) for w in widths)
        return bufs

    def run(self, x: torch.Tensor, positions: np.ndarray, kv_caches: list, metas) -> torch.Tensor | None:
        """Run every decoder layer on the residual stream x [M, hidden] (updated in place) and
        return the last MLP's output (not yet added to x, as the per-layer path leaves it);
        None: this step is not one the graph takes (nothing was touched)."""
        m = x.shape[0]
        group_of = None
        if isinstance(metas, list):
            distinct = list({id(meta): meta for meta in metas}.values())
            if len(distinct) > 1:
                index = {id(meta): g for g, meta in enumerate(distinct)}
                group_of = np.fromiter((index[id(meta)] for meta in metas), dtype=np.int64,
                                       count=len(metas))
            metas = distinct
        else:
            metas = [metas]
        if m > self.max_rows or not all(meta.num_decodes == meta.num_tokens == m for meta in metas) \
                or x.dtype != self.model.dtype or not x.is_contiguous() \
                or not self._caches_taken(kv_caches):
            return None
        groups = np.array([[meta.slot_mapping.data_ptr(), meta.decode_block_tables.ctypes.data,
                            meta.decode_block_tables.shape[1], meta.decode_seq_lens.ctypes.data,
                            meta.decode_rows.ctypes.data, meta.block_size, meta.sliding_window or 0]
                           for meta in metas], dtype=np.int64)
        qkv, attn, o, act, down, normed, gate_up = self._buffers(m)
        rope_cos, rope_sin = self.model.rope_cos, self.model.rope_sin
        self.step[:] = (m, x.data_ptr(), int(x.dtype == torch.bfloat16),
                        KV_DTYPES[kv_caches[0][0].dtype], torch.get_num_threads(),
                        positions.ctypes.data, rope_cos.data_ptr(), rope_sin.data_ptr(),
                        qkv.data_ptr(), attn.data_ptr(), o.data_ptr(), act.data_ptr(), down.data_ptr(),
                        groups.ctypes.data, 0 if group_of is None else group_of.ctypes.data,
                        normed.data_ptr(), gate_up.data_ptr(), self.q8_isa, self.attn_io)
        rc = library().decode_layers(self.step.ctypes.data, self.layers.ctypes.data, len(self.layers))
        if rc != 0:
            raise MemoryError("decode_layers: no memory for a kernel's scratch")
        return down
