"""The C attention backend: decodes through paged_attention.c (an fp32 or bf16 cache) or
paged_attention_quant.c (a one-byte fp8 or int8 cache, on an AVX-512, AVX2 or scalar path),
prompts through the flash-style prompt kernel of prefill_attention.c (AVX512-BF16) or, where it
does not serve, as rows of the decode kernel. `CAttention` is bound to one cache dtype and its
entry points when it is built (selector.py, at load); a call only checks its tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.attention.kv_layout import FP8, UNIT_KV_SCALES, cache_geometry
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.torch_sdpa import attention_with_sdpa
from kvflow.csrc import library, run_kernel

# one-byte caches (paged_attention_quant.c): the kernels' `kind`
Q8_KINDS = {torch.int8: 0, FP8: 1}
Q8_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512-bf16": 3}  # avx512-bf16: fp8's only
IO_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read q as and write out as
VECTOR_HEAD_DIMS = (64, 128)  # head sizes with a vector row in paged_attention.c (AVX2/AVX-512)
# Below a few microseconds of decode attention (~20 ns per head-key) a split costs more than
# it saves.
MIN_PARALLEL_HEAD_KEYS = 256
_DECODE_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_PROMPT_KV_KINDS = {torch.bfloat16: 0, torch.int8: 1, FP8: 2}  # prefill_attention.c's kv_kind


def other_cache_error(chosen: torch.dtype, got: torch.dtype) -> ValueError:
    """What a backend chosen for one KV cache dtype raises when handed a cache of another."""
    return ValueError(f"attention was chosen for a {chosen} KV cache and got a {got} one: choose "
                      f"the kernels for the cache (Kernels.with_kv_dtype) before the step")


def float_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def sinks_word(sinks: torch.Tensor | None, num_heads: int) -> tuple[int, torch.Tensor | None]:
    """The kernels' `sinks` pointer (0: none) and the fp32 [num_heads] tensor it points at (the
    caller keeps it alive through the call)."""
    if sinks is None:
        return 0, None
    if sinks.shape != (num_heads,):
        raise ValueError(f"attention sinks must be one logit per query head ({num_heads}), "
                         f"got shape {tuple(sinks.shape)}")
    sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return sinks.data_ptr(), sinks


def q8_isas() -> tuple[str, ...]:
    """The paths of the one-byte-cache decode kernel this build has (scalar always)."""
    lib = library()
    bits = lib.paged_decode_q8_isas() if lib is not None else 0
    return tuple(name for name, i in Q8_ISAS.items() if bits >> i & 1)


def reads(kv_dtype: torch.dtype) -> bool:
    """The decode kernels read a cache of `kv_dtype`."""
    return kv_dtype in _DECODE_KERNELS or kv_dtype in Q8_KINDS


@dataclass(frozen=True)
class CAttention:
    """Attention of q [T, H, D] over each request's cached K/V -> [T, H * D] through the C
    kernels, for a CPU KV cache of `kv_dtype`: decodes through the decode kernel, prompts
    through the prompt kernel where `prompt_kernel` (it was built: AVX512-BF16) and it takes
    this cache, else as decode rows. `prompt_amx`: the prompt kernel's tile products on AMX;
    `prefetch_all`: the bf16 decode kernel prefetches every next block, also where it follows
    the last in memory (faster on a Xeon with AMX, slower on a Zen 4: paged_attention.c);
    `q8_isa`: the one-byte-cache decode kernel's path (selector.best_q8_isa); `prompt_tiles`:
    prompt tokens taken as decode rows share their loads in tiles.

    The kernel entry points and their fixed words are derived here, once."""

    kv_dtype: torch.dtype
    prompt_kernel: bool = True
    prompt_amx: bool = False
    prefetch_all: bool = False
    q8_isa: str | None = None
    prompt_tiles: bool = True
    decode_kernel: str = field(init=False)
    decode_words: tuple[int, ...] = field(init=False)  # a one-byte cache's kind and path
    decode_flags: int = field(init=False)  # io_bf16's bit 2: prefetch every next block
    prompt_kv_kind: int | None = field(init=False)  # None: prompts as decode rows

    def __post_init__(self):
        if self.kv_dtype in Q8_KINDS:
            if self.q8_isa not in Q8_ISAS:
                raise ValueError(f"a {self.kv_dtype} cache's decode kernel needs one of the paths "
                                 f"{list(Q8_ISAS)}, got {self.q8_isa!r}")
            kernel, words = "paged_decode_q8", (Q8_KINDS[self.kv_dtype], Q8_ISAS[self.q8_isa])
        elif self.kv_dtype in _DECODE_KERNELS:
            kernel, words = _DECODE_KERNELS[self.kv_dtype], ()
        else:
            raise ValueError(f"the C attention kernels do not read a {self.kv_dtype} KV cache")
        bound = dict(decode_kernel=kernel, decode_words=words,
                     decode_flags=4 if self.prefetch_all and kernel == "paged_decode_bf16" else 0,
                     prompt_kv_kind=_PROMPT_KV_KINDS.get(self.kv_dtype) if self.prompt_kernel else None)
        for name, value in bound.items():  # frozen: set once, here
            object.__setattr__(self, name, value)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, num_kv_heads: int,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The step's K/V must already be in the cache (write_kv); `kv_scales` are the layer's
        fp8 (k_scale, v_scale). `k`/`v`, this step's fresh [T, kv_heads, D], optionally spare
        a gather for prompts that have no prior context. `sinks`: fp32 [H], each query head's
        attention-sink logit (None: none), on every path."""
        if k_cache.dtype != self.kv_dtype:
            raise other_cache_error(self.kv_dtype, k_cache.dtype)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype)
        # the kernels write fp32 or bf16; another dtype gets one fp32 buffer, converted at the end
        of = out if out.dtype in IO_DTYPES else torch.empty(q.shape)
        if meta.prefills and not self.prefill(q, k_cache, v_cache, meta, scale, of, kv_scales,
                                              sinks=sinks):
            # Without the prompt kernel, prompt tokens are rows like decodes: each reads its
            # causal prefix from the cache. That ran 1.3-1.5x faster than SDPA per prompt
            # (benchmarks/README.md). Only for head sizes the decode kernel vectorises: its
            # scalar row would be far slower than SDPA.
            if head_dim not in VECTOR_HEAD_DIMS:
                return attention_with_sdpa(q, k_cache, v_cache, meta, scale, num_kv_heads, k, v,
                                           decode_kernel=self.decode, kv_scales=kv_scales,
                                           sinks=sinks)
            self.decode(q, k_cache, v_cache, meta, scale, of, all_tokens=True,
                        kv_scales=kv_scales, tiles=self.prompt_tiles, sinks=sinks)
        elif meta.num_decodes:
            self.decode(q, k_cache, v_cache, meta, scale, of, kv_scales=kv_scales, sinks=sinks)
        if of is not out:
            out.copy_(of)
        return out.reshape(num_tokens, num_heads * head_dim)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor, all_tokens: bool = False,
               kv_scales: tuple[float, float] = UNIT_KV_SCALES, tiles: bool = True,
               sinks: torch.Tensor | None = None) -> bool:
        """Decode rows (or, with `all_tokens`, every token, each one query over its own causal
        prefix) through the decode kernel, straight from the paged cache, into `out`; a
        one-byte cache at the layer's `kv_scales` (fp8's k_scale, v_scale). `tiles` (with
        `all_tokens`): consecutive prompt tokens share their loads in tiles where the kernel
        has them (fp32 q and out on an fp32 or bf16 cache; False: each a row of its own, to
        measure them); `sinks`: as __call__'s. True: done (the SDPA backend's `decode_kernel`
        contract)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        sinks_ptr, sinks = sinks_word(sinks, num_heads)
        block_size, num_kv_heads, _ = cache_geometry(k_cache)
        # q may be a strided view of the fused qkv output: only its heads must be dense
        qf = q if q.dtype in IO_DTYPES and q.stride()[1:] == (head_dim, 1) else q.float().contiguous()
        of = out if out.dtype in IO_DTYPES and out.is_contiguous() else torch.empty(q.shape)
        io_bf16 = int(qf.dtype == torch.bfloat16) | int(of.dtype == torch.bfloat16) << 1
        io_bf16 |= self.decode_flags
        if all_tokens:
            io_bf16 |= 8 if tiles else 0  # bit 3: prompt tokens in tiles (paged_attention.c)
            rows, lens, tables = meta.token_rows()
        else:
            tables, lens, rows = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_rows

        # rows split between threads by key count (the kernel's work is ~ keys)
        threads = torch.get_num_threads() if int(lens.sum()) * num_heads >= MIN_PARALLEL_HEAD_KEYS else 1
        words = [qf.data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.ctypes.data,
                 tables.shape[1], lens.ctypes.data, rows.ctypes.data, num_heads, num_kv_heads,
                 head_dim, block_size, of.data_ptr(), num_heads * head_dim, io_bf16,
                 meta.sliding_window or 0, sinks_ptr]
        if self.decode_words:
            words += [*self.decode_words, *map(float_bits, kv_scales)]
        run_kernel(self.decode_kernel, words, len(rows), threads, farg=scale, weights=lens)
        if of is not out:  # a caller's out in another dtype
            idx = torch.from_numpy(rows)
            out[idx] = of[idx].to(out.dtype)
        return True

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor,
                kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                sinks: torch.Tensor | None = None) -> bool:
        """Prompt rows through the flash-style prompt kernel (prefill_attention.c: bf16 cache,
        or a one-byte one widened to bf16 as it is gathered; AVX512-BF16, 16-token blocks) into
        `out` (fp32 or bf16, contiguous); decode rows untouched. q is read in bf16 (an fp32 q is
        rounded first). A sliding window is the kernel's own: it skips the blocks before it.
        fp8 is widened at the layer's `kv_scales`, passed as one word (k_scale's bits low,
        v_scale's high). `sinks`: as __call__'s. False: the kernel does not serve this cache or
        these heads."""
        if self.prompt_kv_kind is None:
            return False
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads, _ = cache_geometry(k_cache)
        # the shapes come with the tensors (a model may mix head sizes): the kernel says per call
        if not library().paged_prefill_bf16_supported(num_heads, num_kv_heads, head_dim, block_size):
            return False
        if q.dtype != torch.bfloat16 or q.stride()[1:] != (head_dim, 1):
            q = q.to(torch.bfloat16).contiguous()
        starts, qlens, slens, tables = meta.prefill_arrays()
        sinks_ptr, sinks = sinks_word(sinks, num_heads)

        # work items are (prompt, kv head) pairs, weighted by the query x key count they take
        window = meta.sliding_window or 0
        keys = np.minimum(slens, window + qlens) if window else slens
        run_kernel("paged_prefill_bf16",
                   [q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.ctypes.data,
                    tables.shape[1], starts.ctypes.data, qlens.ctypes.data, slens.ctypes.data, num_heads,
                    num_kv_heads, head_dim, block_size, out.data_ptr(), out.stride(0),
                    int(out.dtype == torch.bfloat16), window, self.prompt_kv_kind,
                    float_bits(kv_scales[0]) | float_bits(kv_scales[1]) << 32, int(self.prompt_amx),
                    sinks_ptr],
                   len(qlens) * num_kv_heads, torch.get_num_threads(), farg=scale,
                   weights=np.repeat(qlens * keys, num_kv_heads))
        return True


# One path by name for tests and benchmarks: a CAttention for the cache at hand, built per
# call. The model never calls these: its CAttention is bound at load (selector.py).

def attention_with_kernels(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, num_kv_heads: int,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                           kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                           sinks: torch.Tensor | None = None, **choices) -> torch.Tensor:
    """CAttention(k_cache.dtype, **choices) called once; SDPA for a cache it does not read."""
    if k_cache.device.type != "cpu" or not reads(k_cache.dtype):
        return attention_with_sdpa(q, k_cache, v_cache, meta, scale, num_kv_heads, k, v,
                                   kv_scales=kv_scales, sinks=sinks)
    return CAttention(k_cache.dtype, **choices)(q, k_cache, v_cache, meta, scale, num_kv_heads,
                                                k, v, kv_scales=kv_scales, sinks=sinks)


def decode_with_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor,
                       all_tokens: bool = False, q8_isa: str | None = None,
                       prefetch_all: bool = False, kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                       tiles: bool = True, sinks: torch.Tensor | None = None) -> bool:
    """CAttention.decode for this cache; False: the kernels do not read it."""
    if k_cache.device.type != "cpu" or not reads(k_cache.dtype):
        return False
    return CAttention(k_cache.dtype, prefetch_all=prefetch_all, q8_isa=q8_isa).decode(
        q, k_cache, v_cache, meta, scale, out, all_tokens, kv_scales, tiles, sinks=sinks)


def prefill_with_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, out: torch.Tensor, amx: bool = False,
                        kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                        sinks: torch.Tensor | None = None) -> bool:
    """CAttention.prefill for this cache (`amx`: its prompt_amx); False where it does not serve."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in _PROMPT_KV_KINDS:
        return False
    # the decode path is not taken here: any valid one binds a one-byte cache
    return CAttention(k_cache.dtype, prompt_amx=amx, q8_isa="scalar").prefill(
        q, k_cache, v_cache, meta, scale, out, kv_scales, sinks=sinks)
