"""Draft-model proposer: a smaller model with the target's tokenizer decodes k tokens greedily
for each request, on its own paged KV cache (its own tensors, sized like the target's pool, and
the same block ids: a request's block table is valid in both pools).

Each call first feeds the tokens its cache lacks (the prompt at first; later the last step's
new tokens, minus whatever drafts it had fed that were accepted), then k - 1 single-token steps
for the whole batch at once. The scheduler holds k lookahead slots past each request's tokens,
so those writes stay inside its blocks."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.model.arch import LlamaArchConfig
from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.model.loader import load_model
from kvflow.model.quant.load import resolve_quantization
from kvflow.model_path import resolve_model_path
from kvflow.worker.model_runner import longest_position


@dataclass(slots=True)
class _DraftState:
    fed: list[int] = field(default_factory=list)  # tokens whose K/V sit at positions 0..len-1


class DraftModelProposer:
    def __init__(self, model: str, k: int, target_arch: LlamaArchConfig, dtype: torch.dtype,
                 kv_dtype: torch.dtype, num_blocks: int, block_size: int,
                 max_model_len: int, quantization: str | None = None) -> None:
        self.path = resolve_model_path(model)
        # the draft runs whole in this process (also under tensor parallelism): as one process
        # would serve it, so a quantized GGUF draft stays quantized by default
        self.quantization = resolve_quantization(quantization, self.path)
        self.model, self.arch = load_model(self.path, dtype, quantization=self.quantization)
        if self.arch.vocab_size != target_arch.vocab_size:
            raise ValueError(f"speculative_config.model {model!r} has a vocabulary of "
                             f"{self.arch.vocab_size} tokens; the target's has "
                             f"{target_arch.vocab_size}: a draft model must share the tokenizer")
        if self.arch.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model {model!r} reaches "
                             f"{self.arch.max_position_embeddings} positions, under max_model_len "
                             f"{max_model_len}; lower max_model_len")
        self.model.cover_positions(longest_position(self.arch, max_model_len, num_blocks, block_size))
        self.k = k
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(self.arch, num_blocks, block_size, kv_dtype)
        self.model.kernels = self.model.kernels.with_kv_dtype(kv_dtype)
        self.states: dict[str, _DraftState] = {}

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[str, list[int], list[int], int]]) -> list[list[int]]:
        """items: (request id, its tokens so far, its block table, how many drafts at most)
        -> its drafts. The draft writes positions up to len(tokens) + that many - 2."""
        feeds, starts, tables, states = [], [], [], []
        for rid, tokens, blocks, _ in items:
            st = self.states.setdefault(rid, _DraftState())
            # its cache is valid up to the first position where what it fed differs
            n = min(len(st.fed), len(tokens) - 1)  # the last token is always fed: it samples
            valid = 0
            if n:
                fed, real = np.asarray(st.fed[:n]), np.asarray(tokens[:n])
                diff = np.flatnonzero(fed != real)
                valid = int(diff[0]) if len(diff) else n
            st.fed = list(tokens)
            feeds.append(tokens[valid:])
            starts.append(valid)
            tables.append(blocks)
            states.append(st)
        drafts: list[list[int]] = [[] for _ in items]
        caps = [cap for *_, cap in items]
        active = list(range(len(items)))  # the requests that still draft, in batch order
        lens = np.array([len(f) for f in feeds], dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + lens
        ids = [t for f in feeds for t in f]
        for step in range(max(caps)):
            meta = build_attention_metadata(lens, seq_lens, [tables[i] for i in active],
                                            self.block_size)
            hidden = self.model(torch.tensor(ids, dtype=torch.long), meta.positions,
                                self.kv_caches, meta)
            last = torch.from_numpy(meta.query_start_loc[1:] - 1)
            logits = self.model.compute_logits(hidden[last], as_float=False)
            tokens = [int(t) for t in self.model.kernels.argmax(logits)]
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            keep = [j for j, i in enumerate(active) if caps[i] > step + 1]
            if not keep:
                break
            active = [active[j] for j in keep]
            ids = [tokens[j] for j in keep]
            for i, t in zip(active, ids):
                states[i].fed.append(t)  # its K/V is written by the next forward
            lens = np.ones(len(active), dtype=np.int64)
            seq_lens = seq_lens[keep] + 1
        return drafts
