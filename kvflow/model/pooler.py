"""Embeddings and prompt logprobs: what a prefill chunk's final hidden states yield besides the
next token. Both are gathered chunk by chunk, keeping only what they need between chunks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.model.sampler import LOGPROB_FLOOR
from kvflow.outputs import PromptLogprobsChunk, TokenLogprobs

# Prompt positions whose logits are made at once: 128 rows of a 49k vocabulary are 25 MB of
# fp32, whatever the chunk's length.
PROMPT_LOGPROBS_ROWS = 128


@dataclass(slots=True)
class PoolingState:
    """One embedding request's pooling between its prefill chunks: the fp32 sum of the rows so
    far (MEAN), the first row (CLS), or nothing (LAST reads its prompt's last chunk only)."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    acc: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor, start: int, num_prompt_tokens: int) -> bytes | None:
        """Take the rows of positions `start..start + len(hidden)`; on the prompt's last chunk,
        return the pooled vector as little-endian float32 bytes."""
        end = start + hidden.shape[0]
        if self.pooling_type == "MEAN":
            s = hidden.float().sum(dim=0)
            self.acc = s if self.acc is None else self.acc.add_(s)
        elif self.pooling_type == "CLS" and start == 0:
            self.acc = hidden[0].float().clone()
        if end < num_prompt_tokens:
            return None
        if self.pooling_type == "LAST":
            vec = hidden[-1].float()
        elif self.pooling_type == "MEAN":
            vec = self.acc / num_prompt_tokens
        else:
            vec = self.acc
        if self.normalize:
            vec = F.normalize(vec, dim=0)
        self.acc = None
        return vec.cpu().numpy().astype("<f4").tobytes()


def prompt_logprobs_chunk(compute_logits, hidden: torch.Tensor, token_ids: list[int],
                          start: int, num_prompt_tokens: int, num: int) -> PromptLogprobsChunk | None:
    """Logprobs of the prompt tokens that this chunk's rows predict: row i (position start + i)
    scores prompt token start + i + 1, with the top-`num` beside it. Logits are made
    PROMPT_LOGPROBS_ROWS rows at a time and only those values leave. None when no row of the
    chunk predicts a prompt token (the prompt's last position predicts the first output)."""
    stop = min(start + hidden.shape[0], num_prompt_tokens - 1)  # positions with a next prompt token
    if stop <= start:
        return None
    entries: list[TokenLogprobs] = []
    driver = True
    for lo in range(start, stop, PROMPT_LOGPROBS_ROWS):
        hi = min(lo + PROMPT_LOGPROBS_ROWS, stop)
        logits = compute_logits(hidden[lo - start:hi - start])
        if logits is None:  # a tensor-parallel rank other than the driver: it still joins
            driver = False  # every slice's vocab gather, in step with the driver
            continue
        # log-softmax of the few values that leave only: logit - logsumexp, with one pass
        # over the vocabulary for the norm, one for the rank and one for the top-N
        lse = logits.logsumexp(dim=-1, keepdim=True)
        target = torch.tensor(token_ids[lo + 1:hi + 1], device=logits.device).unsqueeze(1)
        chosen = logits.gather(1, target)
        ranks = ((logits > chosen).sum(dim=-1) + 1).tolist()
        if num:
            top, top_ids = logits.topk(num, dim=-1)
            ids = torch.cat([target, top_ids], dim=1).tolist()
            lps = (torch.cat([chosen, top], dim=1) - lse).clamp_min_(LOGPROB_FLOOR).tolist()
        else:
            ids, lps = target.tolist(), (chosen - lse).clamp_min_(LOGPROB_FLOOR).tolist()
        entries.extend(TokenLogprobs(token_ids=i, logprobs=v, sampled_rank=r)
                       for i, v, r in zip(ids, lps, ranks))
    return PromptLogprobsChunk(start=start + 1, entries=entries) if driver else None
