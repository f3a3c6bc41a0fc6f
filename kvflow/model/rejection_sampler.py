"""Verification of speculative drafts by rejection sampling (Leviathan et al. 2023; Chen et
al. 2023), the rule vLLM's RejectionSampler applies.

A request with k drafts d_1..d_k has k + 1 rows of target logits: row i is the target's
distribution p_i for the token after d_1..d_i. Greedy rows accept d_i while it is the argmax of
p_{i-1}, then take the target's argmax (a bonus token when all k were accepted), so the output
is the one plain greedy decoding gives. Random rows accept d_i with probability
min(1, p(d_i) / q(d_i)); both proposers (n-gram lookup, a draft model decoding greedily) draft
deterministically, so q is one-hot and the test is u < p(d_i). On the first rejection the token
is drawn from the residual max(0, p - q) renormalised (p without d_i); after k acceptances the
bonus token is drawn from p_k. Every emitted token is therefore distributed as p exactly.
A seeded request draws all its uniforms and races from its own generator."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.model.sampler import SamplingMetadata, Sampler, gather_logprobs, random_sample
from kvflow.outputs import TokenLogprobs


def greedy_accept(target: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Greedy verification: `target` holds the target's argmax at each request's
    len(drafts[j]) + 1 rows in order; each request keeps its drafts while they equal it, then
    the target's token."""
    out, start = [], 0
    for d in drafts:
        k, a = len(d), 0
        while a < k and d[a] == target[start + a]:
            a += 1
        out.append(d[:a] + [target[start + a]])
        start += k + 1
    return out


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
                     greedy: list[bool], generators: list[torch.Generator | None],
                     ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """`logits` [R, V]: each request's len(drafts[j]) + 1 rows in order; `meta` describes those
    R rows (one SamplingRow per row). Returns each request's new tokens (its accepted drafts,
    then the target's token) and, where asked, the target's logprobs of each of them."""
    raw = logits.float()
    adjusted = Sampler.adjust(raw, meta)
    counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    argmax = adjusted.argmax(dim=-1).tolist() if any(greedy) else None
    probs = Sampler.probs(adjusted, meta) if not all(greedy) else None
    # p_{i}(d_{i+1}) for every draft of a random row, in one gather
    flat_rows = [s + i for j, (s, d) in enumerate(zip(starts.tolist(), drafts))
                 if not greedy[j] for i in range(len(d))]
    flat_tokens = [t for j, d in enumerate(drafts) if not greedy[j] for t in d]
    p_draft = (probs[flat_rows, flat_tokens].tolist() if flat_rows else [])

    out: list[list[int]] = []
    pos = 0  # into p_draft
    for j, (start, d) in enumerate(zip(starts.tolist(), drafts)):
        k = len(d)
        if greedy[j]:
            target = argmax[start:start + k + 1]
            a = 0
            while a < k and d[a] == target[a]:
                a += 1
            out.append(d[:a] + [target[a]])
            continue
        gen = generators[j]
        u = torch.rand(k, generator=gen).tolist() if k else []  # on the CPU, as seeds draw
        a = 0
        while a < k and u[a] < p_draft[pos + a]:
            a += 1
        pos += k
        row = probs[start + a].clone()
        if a < k:
            row[d[a]] = 0.0  # the residual of a one-hot draft; random_sample normalises implicitly
        token = int(random_sample(row.unsqueeze(0), {0: gen} if gen is not None else {})[0])
        out.append(d[:a] + [token])

    logprobs: list[list[TokenLogprobs] | None] = [None] * len(drafts)
    if meta.logprob_rows:
        asked = sorted({r for r in meta.logprob_rows})
        want = {int(np.searchsorted(starts, r, side="right") - 1) for r in asked}
        rows, toks, nums, owner = [], [], [], []
        n_of_row = dict(zip(meta.logprob_rows, meta.num_logprobs))
        for j in sorted(want):
            for i, t in enumerate(out[j]):
                rows.append(int(starts[j]) + i)
                toks.append(t)
                nums.append(n_of_row[int(starts[j])])
                owner.append(j)
        sub = SamplingMetadata(num_rows=len(rows), vocab_size=meta.vocab_size, all_greedy=False,
                               all_random=False, logprob_rows=list(range(len(rows))),
                               num_logprobs=nums)
        lps = gather_logprobs(raw[rows], torch.tensor(toks, device=raw.device), sub)
        for j, lp in zip(owner, lps):
            if logprobs[j] is None:
                logprobs[j] = []
            logprobs[j].append(lp)
    return out, logprobs
