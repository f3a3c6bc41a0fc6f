"""Paged KV cache: K/V written by slot mapping, read back per request through its block table.

The batch is one flat run of tokens from many requests. Request i owns `query_lens[i]`
consecutive tokens, sitting at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`
of its own sequence; it attends to its own cached context and never to another request."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.csrc import library, run_kernel
from kvflow.model import hugepages
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.cpu_features import cpu_features
from kvflow.model.kv_layout import (FP8, UNIT_KV_SCALES, cache_geometry, cache_shape, read_blocks,
                                    read_rows, write_rows)


def allocate_kv_caches(arch: LlamaArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str | None = None,
                       num_layers: int | None = None,
                       zeros=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer (or per `num_layers`: the tensors that KV cache
    groups share), each [num_blocks, kv_heads, block_size, head_dim] in tiles (kv_layout.py).
    On the CPU, `zeros(numel, dtype)` gives each tensor's memory (default: anonymous memory on
    huge pages; a shared file when another process must reach the cache)."""
    num_layers = arch.num_hidden_layers if num_layers is None else num_layers
    shape = cache_shape(num_blocks, block_size, arch.num_key_value_heads, arch.head_dim, dtype)
    if device is not None and torch.device(device).type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    # Zeroed (unwritten slots may be read under a mask, and 0 * NaN would poison the sum), but
    # as anonymous memory: the OS hands out zero pages on first touch instead of a multi-GiB
    # memset at start-up; on huge pages where granted (kvflow/model/hugepages.py).
    n = int(np.prod(shape))
    zeros = zeros or hugepages.zeros
    return [(zeros(n, dtype).view(shape), zeros(n, dtype).view(shape))
            for _ in range(num_layers)]


@dataclass
class PrefillSeq:
    """A request with more than one query token this step (a prompt or a chunk of one)."""

    token_start: int
    query_len: int
    seq_len: int
    context_slots: torch.Tensor | None  # [seq_len] cache slots of positions 0..seq_len-1; None: no prior context
    mask: torch.Tensor | None  # [query_len, seq_len] bool, causal with offset; None: plain causal


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch; built once, shared by all layers."""

    num_tokens: int
    block_size: int
    positions: np.ndarray  # [T] int64, each token's position in its own sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot where each new token's K/V goes
    query_start_loc: np.ndarray  # [N + 1]
    query_lens: np.ndarray  # [N]
    seq_lens: np.ndarray  # [N]
    block_tables: np.ndarray  # [N, max_blocks] int64, padded with block 0
    # Rows with one query token (decodes) run together in one batched attention call.
    decode_rows: np.ndarray  # [B] int64, token index of each decode row in the flat batch
    decode_seq_lens: np.ndarray  # [B] int64
    decode_block_tables: np.ndarray  # [B, max_decode_blocks] int64, C-contiguous
    prefills: list[PrefillSeq]
    # a query at position p sees keys in (p - sliding_window, p] (None: all keys up to p); one
    # window per KV cache group, so one per metadata
    sliding_window: int | None = None
    # on a GPU: the arrays above on the device (model/gpu_batch.py) and the positions as a
    # device tensor, in a CUDA graph's persistent buffers when one replays the step
    gpu: object | None = None
    device_positions: torch.Tensor | None = None
    _torch_decode: tuple | None = None  # tensors of the PyTorch fallback, built on first use
    _token_rows: tuple | None = None  # (rows, seq_lens, tables) of every token, built on first use
    _prefill_arrays: tuple | None = None  # prefill_arrays(), built on first use

    @property
    def num_decodes(self) -> int:
        return len(self.decode_rows)

    def prefill_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token_start, query_len, seq_len, block_tables) of the prompt rows' requests."""
        if self._prefill_arrays is None:
            seqs = np.flatnonzero(self.query_lens > 1)
            self._prefill_arrays = (np.ascontiguousarray(self.query_start_loc[seqs]),
                                    np.ascontiguousarray(self.query_lens[seqs]),
                                    np.ascontiguousarray(self.seq_lens[seqs]),
                                    np.ascontiguousarray(self.block_tables[seqs]))
        return self._prefill_arrays

    def token_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every token as a row of the decode kernel: its index, the keys it sees (its position
        + 1: causal within its own sequence) and its request's block table."""
        if self._token_rows is None:
            seq_of_token = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
            lens = np.ascontiguousarray(self.positions + 1, dtype=np.int64)
            width = int((lens.max() + self.block_size - 1) // self.block_size)
            tables = np.ascontiguousarray(self.block_tables[seq_of_token, :width])
            self._token_rows = (np.arange(self.num_tokens, dtype=np.int64), lens, tables)
        return self._token_rows


def build_attention_metadata(query_lens: np.ndarray, seq_lens: np.ndarray,
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str | None = None,
                             sliding_window: int | None = None,
                             queries_as_decodes: bool = False) -> AttentionMetadata:
    """Slot mapping, padded block tables and per-path index arrays for one step (with
    `sliding_window`: each query sees only the last `sliding_window` keys up to itself).
    `queries_as_decodes` (a speculative verification step on the CPU: each request's known
    token and its drafts): every token is a decode row over its own causal prefix, as the
    decode kernel serves prompt tokens where the prompt kernel does not, so that the step is
    decode-only for the one-call decode step (model/decode_graph.py)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    n = len(query_lens)
    assert len(seq_lens) == n == len(block_tables), "one query_len, seq_len and block table per request"
    assert (query_lens >= 1).all() and (seq_lens >= query_lens).all()
    lens = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=n)
    table = np.zeros((n, max(int(lens.max(initial=0)), 1)), dtype=np.int64)
    for i, blocks in enumerate(block_tables):  # per request, not per token
        table[i, :len(blocks)] = blocks
    assert ((seq_lens + block_size - 1) // block_size <= lens).all(), \
        "a block table is too short for its sequence"

    query_start_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    is_decode = query_lens == 1
    if is_decode.all():  # the common decode-only step: one token per request
        positions = seq_lens - 1
        slots = table[np.arange(n), positions // block_size] * block_size + positions % block_size
    else:
        seq_of_token = np.repeat(np.arange(n), query_lens)
        positions = (np.arange(num_tokens) - query_start_loc[seq_of_token]
                     + (seq_lens - query_lens)[seq_of_token])
        slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size

    if queries_as_decodes and not is_decode.all():
        width = int((positions.max() + block_size) // block_size)
        return AttentionMetadata(
            num_tokens=num_tokens, block_size=block_size, positions=positions,
            slot_mapping=torch.from_numpy(slots).to(device), query_start_loc=query_start_loc,
            query_lens=query_lens, seq_lens=seq_lens, block_tables=table,
            decode_rows=np.arange(num_tokens, dtype=np.int64),
            decode_seq_lens=np.ascontiguousarray(positions + 1, dtype=np.int64),
            decode_block_tables=np.ascontiguousarray(table[seq_of_token, :width]),
            prefills=[], sliding_window=sliding_window)

    decode_seqs = np.flatnonzero(is_decode)
    decode_seq_lens = seq_lens[decode_seqs]
    dec_blocks = int((decode_seq_lens.max() + block_size - 1) // block_size) if len(decode_seqs) else 1
    decode_tables = np.ascontiguousarray(table[decode_seqs, :dec_blocks])

    prefills = []
    for i in np.flatnonzero(~is_decode):
        q_len, s_len = int(query_lens[i]), int(seq_lens[i])
        windowed = sliding_window is not None and s_len > sliding_window
        if q_len == s_len and not windowed:  # all new: plain causal over this step's own K/V
            prefills.append(PrefillSeq(int(query_start_loc[i]), q_len, s_len, None, None))
            continue
        ctx = np.arange(s_len)
        # query row r sits at position s_len - q_len + r and sees keys 0..that position
        # (a window: the last sliding_window of them)
        qpos = (s_len - q_len + np.arange(q_len))[:, None]
        mask = ctx[None, :] <= qpos
        if windowed:
            mask &= ctx[None, :] > qpos - sliding_window
        ctx_slots = None
        if q_len != s_len:
            ctx_slots = torch.from_numpy(table[i, ctx // block_size] * block_size
                                         + ctx % block_size).to(device)
        prefills.append(PrefillSeq(int(query_start_loc[i]), q_len, s_len, ctx_slots,
                                   torch.from_numpy(mask).to(device)))

    return AttentionMetadata(
        num_tokens=num_tokens,
        block_size=block_size,
        positions=positions,
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=query_start_loc,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=table,
        decode_rows=query_start_loc[decode_seqs],
        decode_seq_lens=decode_seq_lens,
        decode_block_tables=decode_tables,
        prefills=prefills,
        sliding_window=sliding_window,
    )


_WRITERS = {torch.float32: "write_kv_f32", torch.bfloat16: "write_kv_bf16"}
# one-byte caches (paged_attention_quant.c): the kernels' `kind`
Q8_KINDS = {torch.int8: 0, FP8: 1}
Q8_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512-bf16": 3}  # avx512-bf16: fp8's only


def _float_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def q8_isas() -> tuple[str, ...]:
    """The paths of the one-byte-cache decode kernel this build has (scalar always)."""
    lib = library()
    bits = lib.paged_decode_q8_isas() if lib is not None else 0
    return tuple(name for name, i in Q8_ISAS.items() if bits >> i & 1)


def best_q8_isa(features, kv_dtype: torch.dtype | None = None) -> str:
    """The widest one-byte-cache decode path both the build and the CPU have (for an fp8
    cache, `kv_dtype` FP8, AVX512-BF16's)."""
    built = q8_isas()
    if (kv_dtype == FP8 and "avx512-bf16" in built
            and {"avx512f", "avx512bw", "f16c", "avx512_bf16"} <= features.flags):
        return "avx512-bf16"
    if "avx512" in built and {"avx512f", "avx512bw", "f16c"} <= features.flags:
        return "avx512"
    if "avx2" in built and {"avx2", "fma", "f16c"} <= features.flags:
        return "avx2"
    return "scalar"


def write_kv_with_kernel(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
    """Store this step's K/V ([T, kv_heads, head_dim]) at their flat cache slots through the C
    writer (a bf16 cache of fp32 activations gets each value rounded to nearest even; fp8 over
    the layer's `kv_scales`), or kv_layout.write_rows for tensors it does not take."""
    bs, kvh, d = cache_geometry(k_cache)
    kind = Q8_KINDS.get(k_cache.dtype)
    if kind is not None:
        if (k.dtype in _IO_DTYPES and k_cache.device.type == "cpu" and v.dtype == k.dtype
                and k.stride()[1:] == (d, 1) and v.stride() == k.stride()
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            library().write_kv_q8(
                k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), 0, k.shape[0], kvh, d, bs, kind,
                int(k.dtype == torch.bfloat16), *map(_float_bits, kv_scales))
            return
        write_rows(k_cache, v_cache, k, v, slot_mapping, kv_scales)
        return
    writer = _WRITERS.get(k_cache.dtype) if k.dtype == torch.float32 else (
        "copy_kv_bf16" if k.dtype == torch.bfloat16 == k_cache.dtype else None)
    if (writer is not None and k_cache.device.type == "cpu"
            and k.stride()[1:] == (d, 1) and v.stride() == k.stride()
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        getattr(library(), writer)(
            k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), 0, k.shape[0], kvh, d, bs)
        return
    write_rows(k_cache, v_cache, k, v, slot_mapping)


_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_IO_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read q as and write out as
VECTOR_HEAD_DIMS = (64, 128)  # head sizes with a vector row in paged_attention.c (AVX2/AVX-512)
# Below a few microseconds of decode attention (~20 ns per head-key) a split costs more than
# it saves.
MIN_PARALLEL_HEAD_KEYS = 256


def _decode_with_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, out: torch.Tensor,
                        all_tokens: bool = False, q8_isa: str | None = None,
                        prefetch_all: bool = False,
                        kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                        tiles: bool = True) -> bool:
    """Decode rows (or, with `all_tokens`, every token, each one query over its own causal
    prefix) through the C kernel, straight from the paged cache. False: the kernel does not
    take this cache (another dtype or device). A one-byte cache (fp8, int8) is read by
    paged_decode_q8 on its `q8_isa` path (None: the widest this CPU has), fp8 at the layer's
    `kv_scales` (k_scale, v_scale). `prefetch_all`: the
    bf16 kernel prefetches every next block, also where it follows the last in memory (faster
    on a Xeon with AMX, slower on a Zen 4: paged_attention.c). `tiles` (with `all_tokens`):
    consecutive prompt tokens share their loads in tiles where the kernel has them (fp32 q and
    out on an fp32 or bf16 cache; False: each a row of its own, to measure them)."""
    kernel = _decode_kernel(k_cache)
    if kernel is None:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads, _ = cache_geometry(k_cache)
    # q may be a strided view of the fused qkv output: only its heads must be dense
    qf = q if q.dtype in _IO_DTYPES and q.stride()[1:] == (head_dim, 1) else q.float().contiguous()
    of = out if out.dtype in _IO_DTYPES and out.is_contiguous() else torch.empty(q.shape)
    io_bf16 = int(qf.dtype == torch.bfloat16) | int(of.dtype == torch.bfloat16) << 1
    if prefetch_all and kernel == "paged_decode_bf16":
        io_bf16 |= 4
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
             meta.sliding_window or 0]
    if kernel == "paged_decode_q8":
        isa = q8_isa or best_q8_isa(cpu_features(), k_cache.dtype)
        words += [Q8_KINDS[k_cache.dtype], Q8_ISAS[isa], *map(_float_bits, kv_scales)]
    run_kernel(kernel, words, len(rows), threads, farg=scale, weights=lens)
    if of is not out:  # a caller's out in another dtype
        idx = torch.from_numpy(rows)
        out[idx] = of[idx].to(out.dtype)
    return True


def _decode_kernel(k_cache: torch.Tensor) -> str | None:
    """The decode kernel's name for this cache (None: another dtype or device)."""
    if k_cache.device.type != "cpu":
        return None
    return "paged_decode_q8" if k_cache.dtype in Q8_KINDS else _KERNELS.get(k_cache.dtype)


def _prefill_with_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, out: torch.Tensor,
                         amx: bool = False, kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> bool:
    """Prompt rows through the flash-style prompt kernel (prefill_attention.c: bf16 cache, or a
    one-byte one widened to bf16 as it is gathered; AVX512-BF16, 16-token blocks) into `out`
    (fp32 or bf16, contiguous); decode rows untouched. q is read in bf16 (an fp32 q is rounded
    first). A sliding window is the kernel's own: it skips the blocks before it. `amx`: its
    tile products on AMX (the caller checked prefill_amx_available() at load); fp8 widened at
    the layer's `kv_scales`, passed as one word (k_scale's bits low, v_scale's high). False: the
    kernel does not serve this here."""
    lib = library()
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads, _ = cache_geometry(k_cache)
    kv_kind = {torch.bfloat16: 0, torch.int8: 1, FP8: 2}.get(k_cache.dtype)
    if (kv_kind is None or k_cache.device.type != "cpu"
            or not lib.paged_prefill_bf16_supported(num_heads, num_kv_heads, head_dim, block_size)):
        return False
    if q.dtype != torch.bfloat16 or q.stride()[1:] != (head_dim, 1):
        q = q.to(torch.bfloat16).contiguous()
    starts, qlens, slens, tables = meta.prefill_arrays()

    # work items are (prompt, kv head) pairs, weighted by the query x key count they take
    window = meta.sliding_window or 0
    keys = np.minimum(slens, window + qlens) if window else slens
    run_kernel("paged_prefill_bf16",
               [q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.ctypes.data,
                tables.shape[1], starts.ctypes.data, qlens.ctypes.data, slens.ctypes.data, num_heads,
                num_kv_heads, head_dim, block_size, out.data_ptr(), out.stride(0),
                int(out.dtype == torch.bfloat16), window, kv_kind,
                _float_bits(kv_scales[0]) | _float_bits(kv_scales[1]) << 32, int(amx)],
               len(qlens) * num_kv_heads, torch.get_num_threads(), farg=scale,
               weights=np.repeat(qlens * keys, num_kv_heads))
    return True


def _decode_with_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor,
                       kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
    """Fallback: gather each row's blocks (padded to the longest) and run one masked SDPA."""
    if meta._torch_decode is None:
        n_keys = meta.decode_block_tables.shape[1] * meta.block_size
        mask = np.arange(n_keys)[None, :] < meta.decode_seq_lens[:, None]
        if meta.sliding_window is not None:
            mask &= np.arange(n_keys)[None, :] >= (meta.decode_seq_lens - meta.sliding_window)[:, None]
        meta._torch_decode = (torch.from_numpy(meta.decode_rows).to(q.device),
                              torch.from_numpy(meta.decode_block_tables).to(q.device),
                              torch.from_numpy(mask[:, None, None, :]).to(q.device))
    rows, tables, mask = meta._torch_decode
    num_heads = q.shape[1]
    num_kv_heads = cache_geometry(k_cache)[1]
    kd, vd = read_blocks(k_cache, v_cache, tables, kv_scales)  # [B, L, kvh, D] -> [B, kvh, L, D]
    kd, vd = kd.transpose(1, 2).to(q.dtype), vd.transpose(1, 2).to(q.dtype)
    qd = q[rows].unsqueeze(2)  # [B, H, 1, D]
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale,
                                        enable_gqa=num_heads != num_kv_heads)
    out[rows] = od.squeeze(2)


def attention_with_kernels(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, num_kv_heads: int,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                           prompt_kernel: bool = True, prompt_amx: bool = False,
                           prefetch_all: bool = False, q8_isa: str | None = None,
                           kv_scales: tuple[float, float] = UNIT_KV_SCALES,
                           prompt_tiles: bool = True) -> torch.Tensor:
    """Attention of q [T, H, D] over each request's own cached K/V -> [T, H * D], through the
    C kernels: decodes through the decode kernel, prompts through the prompt kernel where
    `prompt_kernel` (it was built: AVX512-BF16) and it takes this cache, else as decode rows;
    `prompt_amx`: the prompt kernel on AMX's tiles; `prefetch_all`: _decode_with_kernel's;
    `kv_scales`: the layer's fp8 (k_scale, v_scale); `prompt_tiles`: prompt tokens taken as
    decode rows share loads in tiles (_decode_with_kernel's `tiles`).

    The step's K/V must already be in the cache (write_kv). `k`/`v`, this step's fresh
    [T, kv_heads, D], optionally spare a gather for prompts that have no prior context."""
    num_tokens, num_heads, head_dim = q.shape
    if _decode_kernel(k_cache) is None:  # a cache the kernels do not read
        return attention_with_sdpa(q, k_cache, v_cache, meta, scale, num_kv_heads, k, v,
                                   kv_scales=kv_scales)
    out = torch.empty(q.shape, dtype=q.dtype)
    # the kernels write fp32 or bf16; another dtype gets one fp32 buffer, converted at the end
    of = out if out.dtype in _IO_DTYPES else torch.empty(q.shape)
    if meta.prefills and not (prompt_kernel and _prefill_with_kernel(q, k_cache, v_cache, meta, scale,
                                                                     of, prompt_amx, kv_scales)):
        # Without the prompt kernel, prompt tokens are rows like decodes: each reads its
        # causal prefix from the cache. That ran 1.3-1.5x faster than SDPA per prompt
        # (benchmarks/README.md). Only for head sizes the decode kernel vectorises: its
        # scalar row would be far slower than SDPA.
        if head_dim not in VECTOR_HEAD_DIMS:
            return attention_with_sdpa(q, k_cache, v_cache, meta, scale, num_kv_heads, k, v,
                                       decode_kernel=True, kv_scales=kv_scales)
        _decode_with_kernel(q, k_cache, v_cache, meta, scale, of, all_tokens=True, q8_isa=q8_isa,
                            prefetch_all=prefetch_all, kv_scales=kv_scales, tiles=prompt_tiles)
    elif meta.num_decodes:
        _decode_with_kernel(q, k_cache, v_cache, meta, scale, of, q8_isa=q8_isa,
                            prefetch_all=prefetch_all, kv_scales=kv_scales)
    if of is not out:
        out.copy_(of)
    return out.reshape(num_tokens, num_heads * head_dim)


def attention_with_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_kv_heads: int,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                        decode_kernel: bool = False,
                        kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> torch.Tensor:
    """attention_with_kernels in PyTorch: each prompt through one SDPA call, decodes through
    one batched, masked SDPA (or, with `decode_kernel`, the C decode kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads
    if k_cache.dtype in Q8_KINDS:  # every key as stored, the kernels' numbers on every path
        k = v = None
    if meta.num_decodes and not (decode_kernel and _decode_with_kernel(q, k_cache, v_cache, meta, scale,
                                                                       out, kv_scales=kv_scales)):
        _decode_with_torch(q, k_cache, v_cache, meta, scale, out, kv_scales)

    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.context_slots is None and k is not None:
            kp, vp = k[rows], v[rows]
        else:
            slots = (p.context_slots if p.context_slots is not None
                     else meta.slot_mapping[rows])
            kp, vp = read_rows(k_cache, v_cache, slots, kv_scales)
        kp = kp.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kvh, S, D]
        vp = vp.transpose(0, 1).unsqueeze(0).to(q.dtype)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=scale, enable_gqa=gqa)
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
