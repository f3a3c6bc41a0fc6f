"""One rank's share of a quantized GGUF file, cut from the stored blocks: the rank decodes and
packs only its rows and columns (kvflow/model/sharding.py's layout), and only the layers of its
pipeline stage, so no rank ever holds the whole model, quantized or float.

Column-parallel weights (q|k|v by heads, gate|up by MLP rows, the vocab-parallel embedding and
LM head) are cut by output rows: any row, since every row is its own run of blocks. Row-parallel
ones (o_proj, down_proj) are cut by input columns, which must fall on the stored format's block
boundary (32 inputs for Q4_0, Q4_1 and Q8_0, 256 for the K-quants) and on the kernels' 32:
where they do not, the load is refused with the numbers. Each block is decoded exactly as
gguf_native.py decodes it in one process, so every rank's packed records are the ones one
process packs for the same outputs and inputs."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.checkpoint.gguf import hf_name, unpermute_qk
from kvflow.checkpoint.gguf_blocks import decode
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.quant.gguf_native import _PROJECTIONS, _quantized
from kvflow.model.quant.packing import BLOCK
from kvflow.model.quant.qlinear import QuantizedWeight
from kvflow.model.sharding import _hf_pieces, _renumber, shard_layout
from kvflow.models.registry import family_of


class _Stored:
    """The file's tensors by HF name, read as stored (memory-mapped: a slice touches only its
    pages)."""

    def __init__(self, path: str, arch: LlamaArchConfig, size: int):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.size = size
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name, arch)
            if name is not None:
                self.tensors[name] = t

    def floats(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.tensors[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        return torch.from_numpy(np.ascontiguousarray(a if rows is None else a[rows[0]:rows[1]]))

    def part(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None, heads: int | None = None) -> tuple:
        """(kind, q, d, m, type) of the stored rows [r0, r1) and input columns [c0, c1)."""
        from gguf.constants import GGML_QUANT_SIZES

        t = self.tensors[name]
        k, n = (int(x) for x in t.shape)
        kind_name = t.tensor_type.name
        block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
        raw = np.asarray(t.data).reshape(n, -1)
        r0, r1 = rows or (0, n)
        c0, c1 = cols or (0, k)
        if cols is not None:
            width = c1 - c0
            step = np.lcm(block, BLOCK)
            if c0 % step or width % step:
                raise ValueError(
                    f"tensor_parallel_size {self.size}: {name} is stored as {kind_name} in blocks "
                    f"of {block} inputs, and each rank's {width} of its {k} inputs do not fall on a "
                    f"{step}-input boundary; serve it with a tensor_parallel_size whose share is a "
                    f"multiple of {step}, or pass --quantization none (float weights)")
        raw = raw[r0:r1, c0 // block * nbytes:c1 // block * nbytes]
        kind, q, d, m = decode(raw, kind_name, r1 - r0, c1 - c0)
        if heads is not None:  # llama.cpp's q/k row order is per head: undone per head
            q, d = unpermute_qk(q, heads), unpermute_qk(d, heads)
            m = None if m is None else unpermute_qk(m, heads)
        return kind, q, d, m, kind_name


def _weight(parts: list[tuple], isa: str, pad_rows: int = 0) -> QuantizedWeight:
    """Parts stacked by rows (and `pad_rows` zero rows: a vocab shard's padding) -> packed."""
    if pad_rows:
        kind, q, d, m, _ = parts[-1]
        parts = parts + [(kind, np.zeros((pad_rows, q.shape[1]), q.dtype),
                          np.zeros((pad_rows, d.shape[1]), d.dtype),
                          None if m is None else np.zeros((pad_rows, m.shape[1]), m.dtype), "")]
    n, k = sum(p[1].shape[0] for p in parts), parts[0][1].shape[1]
    source = "+".join(sorted({p[4] for p in parts if p[4]}))
    return _quantized([p[:4] for p in parts], (n, k), isa, source)


def load_gguf_shard(path: str, arch: LlamaArchConfig, dtype: torch.dtype, isa: str, rank: int,
                    size: int, layers: range | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(float tensors, quantized weights) of rank `rank` of `size` under kvflow's names, as
    gguf_native.load_gguf_native names them; `layers`: a pipeline stage's decoder layers only
    (numbered from 0), the embedding on the first stage, the final norm and LM head on the
    last (a tied head: the embedding's table there too)."""
    layers = range(arch.num_hidden_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == arch.num_hidden_layers
    lay = shard_layout(arch, rank, size)
    family = family_of(arch.architecture)
    permute = family.gguf_permutes_qk(arch.architecture)
    src = _Stored(path, arch, size)
    d = arch.head_dim
    q0, nq = lay.q_head_start * d, lay.num_heads * d
    k0, nk = lay.kv_head_start * d, lay.num_kv_heads * d
    i0, ni = lay.inter_start, lay.intermediate_size
    plain: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantizedWeight] = {}
    for i in layers:
        pieces, p = _hf_pieces(i, arch), f"layers.{i}."

        def rows(piece: str, start: int, count: int, heads: int | None = None) -> tuple:
            name, offset = pieces[piece]
            return src.part(name, rows=(offset + start, offset + start + count), heads=heads)

        hq, hk = (lay.num_heads, lay.num_kv_heads) if permute else (None, None)
        quant[p + "qkv_proj"] = _weight([rows("q", q0, nq, hq), rows("k", k0, nk, hk),
                                         rows("v", k0, nk)], isa)
        quant[p + "o_proj"] = _weight([src.part(pieces["o"][0], cols=(q0, q0 + nq))], isa)
        quant[p + "gate_up_proj"] = _weight([rows("gate", i0, ni), rows("up", i0, ni)], isa)
        quant[p + "down_proj"] = _weight([src.part(pieces["down"][0], cols=(i0, i0 + ni))], isa)
        for name, hf_parts in family.hf_layer_names(i, arch).items():
            if name in _PROJECTIONS:
                continue
            if name == "qkv_bias":
                bias = [pieces[x] for x in ("q_bias", "k_bias", "v_bias")]
                plain[p + name] = torch.cat([
                    src.floats(nm, (off + s, off + s + c))
                    for (nm, off), (s, c) in zip(bias, ((q0, nq), (k0, nk), (k0, nk)))])
            elif name.endswith("norm"):  # norms span the hidden size: replicated
                plain[p + name] = torch.cat([src.floats(h) for h in hf_parts])
            else:
                raise ValueError(f"{arch.architecture}: layer tensor {name} is not sharded for "
                                 "quantized tensor parallelism; pass --quantization none")
    pad = lay.vocab_per_rank - (lay.vocab_end - lay.vocab_start)
    vocab = (lay.vocab_start, lay.vocab_end)
    if first or (last and arch.tie_word_embeddings):
        quant["embed_tokens"] = _weight([src.part("model.embed_tokens.weight", rows=vocab)], isa, pad)
    if last:
        plain["norm"] = src.floats("model.norm.weight")
        quant["lm_head"] = (quant["embed_tokens"] if arch.tie_word_embeddings else
                            _weight([src.part("lm_head.weight", rows=vocab)], isa, pad))
    del src  # unmaps the file
    plain = {k: v.to(dtype).contiguous() for k, v in plain.items()}
    if layers.start:  # a later stage: its first layer is the module's layers.0
        plain = {_renumber(k, layers.start): v for k, v in plain.items()}
        quant = {_renumber(k, layers.start): v for k, v in quant.items()}
    return plain, quant
