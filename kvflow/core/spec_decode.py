"""Speculative decoding's bookkeeping: the n-gram (prompt lookup) proposer, when a request or a
step speculates at all, and the acceptance counts. Pure numpy, no model: the target model checks
the drafts in the runner (kvflow/model/rejection_sampler.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SpecDecodeStats:
    """Counts since start, with vLLM's meanings: a draft is one request's run of drafts in one
    step; its tokens are checked one by one and accepted up to the first mismatch."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per checked draft run: the accepted ones plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to `k` tokens that followed the latest occurrence of the longest suffix of
    `tokens` (between `min_n` and `max_n` long) seen earlier in `tokens`; empty if none.

    Vectorised: every earlier position holding the last token is a candidate; one [C, max_n]
    comparison gives each candidate's match length (walking back from it), and the longest,
    latest one wins."""
    n = len(tokens)
    if n < min_n + 1:
        return tokens[:0]
    # candidate i: tokens[i] == tokens[-1], and i + 1 < n so something follows it
    cand = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])
    if len(cand) == 0:
        return tokens[:0]
    width = min(max_n, n - 1)
    back = np.arange(width)
    idx = cand[:, None] - back[None, :]  # [C, width] positions walking back from each candidate
    valid = idx >= 0
    same = valid & (tokens[np.where(valid, idx, 0)] == tokens[n - 1 - back][None, :])
    # match length: leading run of True per row
    length = np.where(same.all(axis=1), width, np.argmin(same, axis=1))
    best = int(length.max())
    if best < min_n:
        return tokens[:0]
    i = int(cand[np.flatnonzero(length == best)[-1]])  # the latest of the longest
    return tokens[i + 1:i + 1 + k]


class NgramProposer:
    """Prompt lookup decoding (vLLM's `ngram` method). Keeps each request's tokens in a numpy
    buffer that grows by the step's new tokens, so a step costs O(new tokens) to maintain plus
    one vectorised scan."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, req_id: str, all_token_ids: list[int]) -> list[int]:
        buf, n = self._buffers.get(req_id, (None, 0))
        total = len(all_token_ids)
        if buf is None or total > len(buf) or total < n:
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            grown[:total] = all_token_ids
            buf = grown
        elif total > n:
            buf[n:total] = all_token_ids[n:]
        self._buffers[req_id] = (buf, total)
        return ngram_propose(buf[:total], self.min_n, self.max_n, self.k).tolist()

    def propose_batch(self, items) -> list[list[int]]:
        """items: (request id, its tokens, its block table (unused), most drafts) each."""
        return [self.propose(rid, tokens)[:cap] for rid, tokens, _, cap in items]

    def forget(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)


class SpecPolicy:
    """When speculation pays. Not in a step that runs `disable_by_batch_size` requests or
    more (the forward is compute-bound there: checking k + 1 tokens costs about k + 1 times
    one); not for a request whose drafts were accepted less often than `min_acceptance_rate`
    once it has had `warmup` drafts checked."""

    def __init__(self, disable_by_batch_size: int, min_acceptance_rate: float,
                 warmup: int = 32, one_call_rows: int = 0) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.warmup = warmup
        # the most rows a decode-only step runs in one call on this model (the engine's
        # executor says; 0: none, or unknown)
        self.one_call_rows = one_call_rows

    def step_allows(self, num_running: int) -> bool:
        return num_running < self.disable_by_batch_size

    def step_drafts(self, num_running: int, k: int) -> int:
        """Drafts per request for the next step: k, or fewer where k would push the step past
        the one-call decode step's rows (into the per-layer path and, on the fp32 GEMV,
        oneDNN: a 10-row fp32 step cost 1.9x a 5-row one, a 36-row Q4_1 step 3.9x an 8-row
        one) while at least one each still fits. One request on the AVX2 GEMV (4 rows) checks
        3 drafts, not 4; two on the AVX-512 one (8 rows) 3 each; eight Q4_1 requests (16
        rows) 1 each; eight on the fp32 GEMV take k (none would fit, and at 90% acceptance
        k pays there)."""
        rows = self.one_call_rows
        if rows <= 0 or num_running * (1 + k) <= rows:
            return k
        fit = rows // max(num_running, 1) - 1
        return fit if fit >= 1 else k

    def request_allows(self, num_draft_tokens: int, num_accepted_tokens: int) -> bool:
        return (num_draft_tokens < self.warmup
                or num_accepted_tokens >= self.min_acceptance_rate * num_draft_tokens)
