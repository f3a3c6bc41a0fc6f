"""Paged KV cache: K/V written by slot mapping, read back per request through its block table.

The batch is one flat run of tokens from many requests. Request i owns `query_lens[i]`
consecutive tokens, sitting at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`
of its own sequence; it attends to its own cached context and never to another request."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.model.arch import LlamaArchConfig


def allocate_kv_caches(arch: LlamaArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str | None = None,
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_hidden_layers)]


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
    block_tables: torch.Tensor  # [N, max_blocks] int64, padded with block 0
    # Rows with one query token (decodes) run together in one batched attention call.
    decode_token_idx: torch.Tensor  # [B] token index of each decode row in the flat batch
    decode_block_tables: torch.Tensor  # [B, max_decode_blocks]
    decode_key_mask: torch.Tensor  # [B, 1, 1, max_decode_blocks * block_size] True where key < seq_len
    prefills: list[PrefillSeq]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.shape[0])


def build_attention_metadata(query_lens: np.ndarray, seq_lens: np.ndarray,
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str | None = None) -> AttentionMetadata:
    """Slot mapping, padded block tables and per-path index tensors for one step."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    n = len(query_lens)
    assert len(seq_lens) == n == len(block_tables), "one query_len, seq_len and block table per request"
    assert (query_lens >= 1).all() and (seq_lens >= query_lens).all()
    max_blocks = max((len(b) for b in block_tables), default=0)
    table = np.zeros((n, max(max_blocks, 1)), dtype=np.int64)
    for i, blocks in enumerate(block_tables):  # per request, not per token
        table[i, :len(blocks)] = blocks
    assert ((seq_lens + block_size - 1) // block_size <= [len(b) for b in block_tables]).all(), \
        "a block table is too short for its sequence"

    query_start_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(n), query_lens)
    positions = (np.arange(num_tokens) - query_start_loc[seq_of_token]
                 + (seq_lens - query_lens)[seq_of_token])
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size

    decode_seqs = np.flatnonzero(query_lens == 1)
    decode_seq_lens = seq_lens[decode_seqs]
    dec_blocks = int((decode_seq_lens.max() + block_size - 1) // block_size) if len(decode_seqs) else 1
    decode_mask = np.arange(dec_blocks * block_size)[None, :] < decode_seq_lens[:, None]

    prefills = []
    for i in np.flatnonzero(query_lens > 1):
        q_len, s_len = int(query_lens[i]), int(seq_lens[i])
        if q_len == s_len:  # the whole sequence is new: plain causal over this step's own K/V
            prefills.append(PrefillSeq(int(query_start_loc[i]), q_len, s_len, None, None))
            continue
        ctx = np.arange(s_len)
        ctx_slots = table[i, ctx // block_size] * block_size + ctx % block_size
        # query row r sits at position s_len - q_len + r and sees keys 0..that position
        mask = ctx[None, :] <= (s_len - q_len + np.arange(q_len))[:, None]
        prefills.append(PrefillSeq(int(query_start_loc[i]), q_len, s_len,
                                   torch.from_numpy(ctx_slots).to(device),
                                   torch.from_numpy(mask).to(device)))

    return AttentionMetadata(
        num_tokens=num_tokens,
        block_size=block_size,
        positions=positions,
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=query_start_loc,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=torch.from_numpy(table).to(device),
        decode_token_idx=torch.from_numpy(query_start_loc[decode_seqs]).to(device),
        decode_block_tables=torch.from_numpy(table[decode_seqs, :dec_blocks]).to(device),
        decode_key_mask=torch.from_numpy(decode_mask[:, None, None, :]).to(device),
        prefills=prefills,
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, kv_heads, head_dim]) at their flat cache slots."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, num_kv_heads: int,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over each request's own cached K/V -> [T, H * D].

    The step's K/V must already be in the cache (write_kv). `k`/`v`, this step's fresh
    [T, kv_heads, D], optionally spare a gather for prompts that have no prior context."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads

    if meta.num_decodes:
        b = meta.num_decodes
        # [B, blocks, block_size, kvh, D] -> [B, kvh, L, D]
        kd = k_cache[meta.decode_block_tables].view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[meta.decode_block_tables].view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_key_mask,
                                            scale=scale, enable_gqa=gqa)
        out[meta.decode_token_idx] = od.squeeze(2)

    kvh_d = (num_kv_heads, head_dim)
    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.context_slots is None and k is not None:
            kp, vp = k[rows], v[rows]
        else:
            slots = (p.context_slots if p.context_slots is not None
                     else meta.slot_mapping[rows])
            kp = k_cache.view(-1, *kvh_d)[slots]
            vp = v_cache.view(-1, *kvh_d)[slots]
        kp = kp.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kvh, S, D]
        vp = vp.transpose(0, 1).unsqueeze(0).to(q.dtype)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=scale, enable_gqa=gqa)
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
