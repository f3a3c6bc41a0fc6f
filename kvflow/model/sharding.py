"""Tensor-parallel sharding of the Llama module's families (Llama and its relatives, Gemma 3):
which rows and columns of each fused weight a rank owns, and reading just those from the
checkpoint; the family (kvflow/models/) names its tensors and says how a norm is held.

Megatron's layout, as in vLLM: Q/K/V and gate/up are column-parallel (each rank computes its
own heads and its slice of the MLP), O and down are row-parallel (partial sums, all-reduced),
the embedding and LM head are split by vocabulary rows. KV heads are split across ranks; with
fewer KV heads than ranks each KV head is replicated on the ranks whose query heads read it.
Norms (the family's `hf_norm_names`, as its `norm_weight` holds them) and RoPE are
replicated. An expert layer splits every expert (and Qwen2-MoE's shared
expert) along its intermediate dimension like a dense MLP, the router and the shared expert's
gate replicated, so each rank routes every token and all-reduces its partial sums. Slices are read with safetensors' `get_slice`, so a rank never
holds more than its share of the model (plus one tensor's slice in flight); the loader builds
the rank's model from them (kvflow.model.loader.load_sharded_model)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvflow.checkpoint.conversion_cache import ensure_gguf_cache
from kvflow.checkpoint.hf_folder import hf_weight_files
from kvflow.model.arch import LlamaArchConfig
from kvflow.model_path import is_gguf
from kvflow.models.registry import family_of


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds, in global indices (heads, MLP columns, vocab rows)."""

    rank: int
    size: int
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    intermediate_size: int
    vocab_start: int
    vocab_end: int  # real rows end here; the shard is padded to vocab_per_rank
    vocab_per_rank: int


def check_tp_size(arch: LlamaArchConfig, size: int) -> None:
    """ValueError naming the numbers when `arch` cannot be split `size` ways."""
    h, kvh, inter = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    if h % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the number of attention "
                         f"heads ({h})")
    if (kvh % size) if kvh >= size else (size % kvh):
        raise ValueError(f"tensor_parallel_size {size} must divide the number of KV heads ({kvh}) "
                         f"or be a multiple of it")
    if inter % size and any(not arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)):
        raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size ({inter})")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if arch.num_experts and getattr(arch, name) % size:
            raise ValueError(f"tensor_parallel_size {size} must divide {name} ({getattr(arch, name)})")


def shard_layout(arch: LlamaArchConfig, rank: int, size: int) -> ShardLayout:
    check_tp_size(arch, size)
    heads, kvh = arch.num_attention_heads // size, arch.num_key_value_heads
    if kvh >= size:
        local_kv, kv_start = kvh // size, rank * (kvh // size)
    else:  # replicated: ranks rank*kvh//size share KV head r // (size // kvh)
        local_kv, kv_start = 1, rank // (size // kvh)
    inter = arch.intermediate_size // size  # (0 rows where only expert layers use it)
    per_rank = -(-arch.vocab_size // size)
    v0 = min(rank * per_rank, arch.vocab_size)
    return ShardLayout(rank, size, rank * heads, heads, kv_start, local_kv, rank * inter, inter,
                       v0, min(v0 + per_rank, arch.vocab_size), per_rank)


def local_arch(arch: LlamaArchConfig, size: int) -> LlamaArchConfig:
    """The shapes of one rank's shard (the same on every rank), as an arch config: the model
    and the KV cache are built from it unchanged."""
    lay = shard_layout(arch, 0, size)
    return replace(arch, num_attention_heads=lay.num_heads, num_key_value_heads=lay.num_kv_heads,
                   intermediate_size=lay.intermediate_size, vocab_size=lay.vocab_per_rank,
                   moe_intermediate_size=arch.moe_intermediate_size // size,
                   shared_expert_intermediate_size=arch.shared_expert_intermediate_size // size)


def kv_bytes_per_token_per_rank(arch: LlamaArchConfig, size: int, dtype_bytes: int,
                                scale_bytes: int = 0) -> int:
    """KV bytes one token occupies in one rank's share of the cache (`scale_bytes` per token
    and kv head: an int8 cache's scales)."""
    return local_arch(arch, size).kv_bytes_per_token(dtype_bytes, scale_bytes) if size > 1 \
        else arch.kv_bytes_per_token(dtype_bytes, scale_bytes)


# -- reading slices ----------------------------------------------------------------------------
class _Checkpoint:
    """Tensors by name across a checkpoint's files; `read` returns only the requested slice."""

    def __init__(self, files: list[str], rename=None) -> None:
        """`rename`: a stored name -> the name it is read by (default: itself)."""
        from safetensors import safe_open

        rename = rename or (lambda name: name)
        self._handles = {f: safe_open(f, framework="pt") for f in files}
        self._stored: dict[str, tuple[str, str]] = {}  # read name -> (file, stored name)
        for f, h in self._handles.items():
            for name in h.keys():
                self._stored[rename(name)] = (f, name)
        self._mapped: dict[str, torch.Tensor] = {}

    @classmethod
    def from_torch_bin(cls, path: str, rename=None) -> "_Checkpoint":
        ckpt = cls([])
        # mmap: slicing touches only the pages of the slice
        mapped = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        ckpt._mapped = mapped if rename is None else {rename(k): v for k, v in mapped.items()}
        return ckpt

    def __contains__(self, name: str) -> bool:
        return name in self._stored or name in self._mapped

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None, index: tuple | None = None) -> torch.Tensor:
        """The whole tensor, or its `rows`, its `cols`, or any `index` (a tuple of slices)."""
        if name not in self:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        if name in self._mapped:
            src = self._mapped[name]
        else:
            f, stored = self._stored[name]
            src = self._handles[f].get_slice(stored)
        if index is not None:
            return src[index]
        if rows is not None:
            return src[rows[0]:rows[1]]
        if cols is not None:
            return src[:, cols[0]:cols[1]]
        return src[:]


_PIECES = (("qkv_proj", ("q", "k", "v")), ("qkv_bias", ("q_bias", "k_bias", "v_bias")),
           ("gate_up_proj", ("gate", "up")), ("o_proj", ("o",)), ("down_proj", ("down",)))


def _hf_pieces(i: int, arch: LlamaArchConfig) -> dict[str, tuple[str, int]]:
    """Layer i's pieces in the family's HF checkpoint (kvflow/models/): each at a row offset
    of the tensor that holds it (a checkpoint that fuses q/k/v or gate/up, as Phi-3's, holds
    several pieces in one tensor)."""
    names = family_of(arch.architecture).hf_layer_names(i, arch)
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    sizes = {"q": q, "k": kv, "v": kv, "q_bias": q, "k_bias": kv, "v_bias": kv,
             "gate": arch.intermediate_size, "up": arch.intermediate_size, "o": 0, "down": 0}
    out = {name: (parts[0], 0) for name, parts in names.items() if len(parts) == 1}
    for fused, pieces in _PIECES:
        parts, offset = names.get(fused), 0
        if parts is None:
            continue
        for j, piece in enumerate(pieces):
            out[piece] = (parts[0], offset) if len(parts) == 1 else (parts[j], 0)
            offset += sizes[piece]
    return out


def _fused_names(i: int, arch: LlamaArchConfig) -> dict[str, tuple[str, int]]:
    """kvflow's own fused names (the GGUF conversion cache): pieces sit at row offsets."""
    p = f"layers.{i}."
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    return {"q": (p + "qkv_proj", 0), "k": (p + "qkv_proj", q), "v": (p + "qkv_proj", q + kv),
            "q_bias": (p + "qkv_bias", 0), "k_bias": (p + "qkv_bias", q),
            "v_bias": (p + "qkv_bias", q + kv), "o": (p + "o_proj", 0),
            "gate": (p + "gate_up_proj", 0), "up": (p + "gate_up_proj", inter),
            "down": (p + "down_proj", 0)}


def _expert_shard(ckpt: "_Checkpoint", arch: LlamaArchConfig, i: int, fused: bool, rank: int,
                  size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer i's expert block on rank `rank`: the router and the shared expert's gate whole,
    every expert's (and the shared expert's) intermediate columns split like a dense MLP's."""
    inter, shared = arch.moe_intermediate_size, arch.shared_expert_intermediate_size
    n, ns = inter // size, shared // size
    e0, s0 = rank * n, rank * ns
    q, out = f"layers.{i}.moe.", {}
    if fused:  # kvflow's own stacked names (the GGUF conversion cache)
        out[q + "router"] = ckpt.read(q + "router")
        gate_up = q + "gate_up"
        out[q + "gate_up"] = torch.cat([ckpt.read(gate_up, index=(slice(None), slice(e0, e0 + n))),
                                        ckpt.read(gate_up, index=(slice(None), slice(inter + e0, inter + e0 + n)))], 1)
        out[q + "down"] = ckpt.read(q + "down", index=(slice(None), slice(None), slice(e0, e0 + n)))
        if shared:
            out[q + "shared_gate_up"] = torch.cat([ckpt.read(q + "shared_gate_up", rows=(s0, s0 + ns)),
                                                   ckpt.read(q + "shared_gate_up", rows=(shared + s0, shared + s0 + ns))])
            out[q + "shared_down"] = ckpt.read(q + "shared_down", cols=(s0, s0 + ns))
            out[q + "shared_gate"] = ckpt.read(q + "shared_gate")
        return {k: v.to(dtype) for k, v in out.items()}
    p, router, gate, up, down = family_of(arch.architecture).expert_names(i, arch)
    experts = range(arch.num_experts)
    out[q + "router"] = ckpt.read(router)
    out[q + "gate_up"] = torch.stack([torch.cat([ckpt.read(gate.format(e), rows=(e0, e0 + n)),
                                                 ckpt.read(up.format(e), rows=(e0, e0 + n))]) for e in experts])
    out[q + "down"] = torch.stack([ckpt.read(down.format(e), cols=(e0, e0 + n)) for e in experts])
    if shared:
        s = p + "shared_expert."
        out[q + "shared_gate_up"] = torch.cat([ckpt.read(s + "gate_proj.weight", rows=(s0, s0 + ns)),
                                               ckpt.read(s + "up_proj.weight", rows=(s0, s0 + ns))])
        out[q + "shared_down"] = ckpt.read(s + "down_proj.weight", cols=(s0, s0 + ns))
        out[q + "shared_gate"] = ckpt.read(p + "shared_expert_gate.weight")
    return {k: v.to(dtype) for k, v in out.items()}


def load_shard(path: str, arch: LlamaArchConfig, dtype: torch.dtype, rank: int,
               size: int, layers: range | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights under kvflow's fused names, read slice by slice. `layers`: a
    pipeline stage's decoder layers only (numbered from 0 in the result), with the embedding
    on the first stage and the final norm and LM head on the last."""
    layers = range(arch.num_hidden_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == arch.num_hidden_layers
    lay = shard_layout(arch, rank, size)
    family = family_of(arch.architecture)
    if is_gguf(path):  # the conversion cache: kvflow's names, norms as the module holds them
        ckpt, fused = _Checkpoint([ensure_gguf_cache(path, dtype)]), True
        glob_names = {name: name for name in ("embed_tokens", "lm_head", "norm")}
    else:
        ckpt, fused = _open_hf_folder(path, family.hf_name), False
        glob_names = family.hf_global_names
    d = arch.head_dim

    def norm(name: str) -> torch.Tensor:
        w = ckpt.read(name)
        return w if fused else family.norm_weight(w.to(dtype), dtype)

    def rows(names: dict, piece: str, start: int, count: int) -> torch.Tensor:
        name, offset = names[piece]
        return ckpt.read(name, rows=(offset + start, offset + start + count)).to(dtype)

    def vocab_rows(name: str) -> torch.Tensor:
        out = torch.zeros(lay.vocab_per_rank, arch.hidden_size, dtype=dtype)
        out[:lay.vocab_end - lay.vocab_start] = ckpt.read(name, rows=(lay.vocab_start, lay.vocab_end))
        return out

    out = {}
    if first or (last and arch.tie_word_embeddings):
        out["embed_tokens"] = vocab_rows(glob_names["embed_tokens"])
    if last:
        out["norm"] = norm(glob_names["norm"])
        if not arch.tie_word_embeddings:
            out["lm_head"] = vocab_rows(glob_names["lm_head"])
    q0, nq = lay.q_head_start * d, lay.num_heads * d
    k0, nk = lay.kv_head_start * d, lay.num_kv_heads * d
    i0, ni = lay.inter_start, lay.intermediate_size
    for i in layers:
        names = _fused_names(i, arch) if fused else _hf_pieces(i, arch)
        p = f"layers.{i}."
        for name, hf_name in family.hf_norm_names(i, arch).items():  # replicated
            out[p + name] = norm(p + name if fused else hf_name)
        out[p + "qkv_proj"] = torch.cat([rows(names, "q", q0, nq), rows(names, "k", k0, nk),
                                         rows(names, "v", k0, nk)])
        if arch.attention_bias:
            out[p + "qkv_bias"] = torch.cat([rows(names, "q_bias", q0, nq),
                                             rows(names, "k_bias", k0, nk),
                                             rows(names, "v_bias", k0, nk)])
        out[p + "o_proj"] = ckpt.read(names["o"][0], cols=(q0, q0 + nq)).to(dtype)
        if arch.is_moe_layer(i):
            out.update(_expert_shard(ckpt, arch, i, fused, rank, size, dtype))
            continue
        out[p + "gate_up_proj"] = torch.cat([rows(names, "gate", i0, ni), rows(names, "up", i0, ni)])
        out[p + "down_proj"] = ckpt.read(names["down"][0], cols=(i0, i0 + ni)).to(dtype)
    if layers.start:  # a later stage: its first layer is the module's layers.0
        out = {_renumber(k, layers.start): v for k, v in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


def _renumber(name: str, offset: int) -> str:
    if not name.startswith("layers."):
        return name
    i, rest = name[len("layers."):].split(".", 1)
    return f"layers.{int(i) - offset}.{rest}"


def _open_hf_folder(path: str, rename=None) -> _Checkpoint:
    files, bin_path = hf_weight_files(path)
    return _Checkpoint(files, rename) if bin_path is None else _Checkpoint.from_torch_bin(bin_path, rename)
