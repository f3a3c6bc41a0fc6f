"""One step's attention metadata: what every layer's attention needs about the flat batch,
built once per step (slot mapping, block tables, which rows decode and which are prompts).

The batch is one flat run of tokens from many requests. Request i owns `query_lens[i]`
consecutive tokens, sitting at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`
of its own sequence; it attends to its own cached context and never to another request.
K/V are written by slot mapping and read back per request through its block table."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
    # a model with state layers (kvflow/layers/short_conv.py): [N] int64, each request's state
    # slot; and the prefix-cache snapshots this step takes: request's row -> (the offset in its
    # chunk of the token after which the state is kept, the snapshot's slot)
    state_slots: np.ndarray | None = None
    state_saves: dict | None = None
    # on a GPU: the arrays above on the device (kvflow/model/gpu_batch.py) and the positions as a
    # device tensor, in a CUDA graph's persistent buffers when one replays the step
    gpu: object | None = None
    device_positions: torch.Tensor | None = None
    # a vision-language model's image runs in this step's prompt chunks, each attended
    # bidirectionally within the run (bidirectional.py): empty for text
    bidirectional_runs: list = field(default_factory=list)
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
    decode-only for the one-call decode step (kvflow/model/decode_graph.py)."""
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
