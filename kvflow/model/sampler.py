"""Batched sampling: logit bias, penalties, temperature, top-k / top-p / min-p, seeded draws,
logprobs.

One call handles every row that samples this step. Each stage is skipped when no row uses it,
so an all-greedy batch is a single argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.outputs import TokenLogprobs
from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row (one request) of the logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step
    generator: torch.Generator | None = None  # CPU generator of a seeded request, made once per request
    eos_token_ids: tuple[int, ...] = ()  # all of them are banned until min_tokens
    # (token ids, biases) of params.logit_bias as tensors; the runner makes them once per request
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None


def logit_bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A request's logit_bias as (ids, biases) tensors, or None without one."""
    if not params.logit_bias:
        return None
    return (torch.tensor(list(params.logit_bias), dtype=torch.long),
            torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step batch tensors; a field is None when no row needs that stage."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None  # [S] bool, only for mixed batches
    temperature: torch.Tensor | None = None  # [S] float, 1.0 for greedy rows
    top_k: torch.Tensor | None = None  # [S] long, vocab_size where disabled
    max_top_k: int = 0  # largest enabled top_k, so top-k alone needs a topk of that width only
    top_p: torch.Tensor | None = None  # [S] float, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [S] float, 0.0 where disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    # Penalties (tokens padded with vocab_size, which lands in a dropped extra column).
    repetition_penalty: torch.Tensor | None = None  # [S]
    presence_penalty: torch.Tensor | None = None  # [S]
    frequency_penalty: torch.Tensor | None = None  # [S]
    prompt_token_ids: torch.Tensor | None = None  # [S, P] long, only with repetition penalty
    output_token_ids: torch.Tensor | None = None  # [S, O] long, only with any penalty
    # logit_bias: (row, token) pairs and the bias added to each, one scatter-add per step.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # min_tokens: (row, token) pairs forced to -inf this step.
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    grammar_masked: bool = False  # a grammar masked some rows' logits this step (set by the runner)
    # logprobs: rows that want them and how many top tokens each.
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None and self.presence_penalty is None \
            and self.frequency_penalty is None


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


def _pad(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = np.full((len(lists), max(width, 1)), pad, dtype=np.int64)
    for i, x in enumerate(lists):  # one C-level copy per row
        out[i, :len(x)] = x
    return torch.from_numpy(out)


def build_sampling_metadata(rows: list[SamplingRow], vocab_size: int,
                            device: str | torch.device = "cpu") -> SamplingMetadata:
    """Collect the rows' settings into batch tensors (done once per step)."""
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    meta = SamplingMetadata(num_rows=len(rows), vocab_size=vocab_size,
                            all_greedy=all(greedy), all_random=not any(greedy))

    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    if not meta.all_greedy:
        if not meta.all_random:
            meta.greedy_mask = tensor(greedy, torch.bool)
        meta.temperature = tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)])
        if any(p.top_k > 0 and not g for g, p in zip(greedy, params)):
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 and not g else vocab_size
                  for g, p in zip(greedy, params)]
            meta.top_k = tensor(ks, torch.long)
            meta.max_top_k = max((k for k in ks if k < vocab_size), default=vocab_size)
        if any(p.top_p < 1.0 and not g for g, p in zip(greedy, params)):
            meta.top_p = tensor([p.top_p for p in params])
        if any(p.min_p > 0.0 and not g for g, p in zip(greedy, params)):
            meta.min_p = tensor([p.min_p for p in params])
        meta.generators = {i: r.generator for i, (r, g) in enumerate(zip(rows, greedy))
                           if r.generator is not None and not g}

    rep = any(p.repetition_penalty != 1.0 for p in params)
    pres = any(p.presence_penalty != 0.0 for p in params)
    freq = any(p.frequency_penalty != 0.0 for p in params)
    if rep:
        meta.repetition_penalty = tensor([p.repetition_penalty for p in params])
        meta.prompt_token_ids = _pad([r.prompt_token_ids for r in rows], vocab_size).to(device)
    if pres:
        meta.presence_penalty = tensor([p.presence_penalty for p in params])
    if freq:
        meta.frequency_penalty = tensor([p.frequency_penalty for p in params])
    if rep or pres or freq:
        meta.output_token_ids = _pad([r.output_token_ids for r in rows], vocab_size).to(device)

    biases = [(i, b) for i, b in enumerate(r.logit_bias or logit_bias_tensors(r.params)
                                           for r in rows) if b is not None]
    if biases:
        meta.bias_rows = torch.repeat_interleave(
            torch.tensor([i for i, _ in biases]), torch.tensor([len(b[0]) for _, b in biases])
        ).to(device)
        meta.bias_tokens = torch.cat([b[0] for _, b in biases]).to(device)
        meta.bias_values = torch.cat([b[1] for _, b in biases]).to(device)

    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            # EOS is masked even with ignore_eos: min_tokens is a promise about length.
            ids = [*(r.params.stop_token_ids or ()), *r.eos_token_ids]
            ban_rows += [i] * len(ids)
            ban_tokens += ids
    if ban_tokens:
        meta.banned_rows = tensor(ban_rows, torch.long)
        meta.banned_tokens = tensor(ban_tokens, torch.long)

    for i, p in enumerate(params):
        if p.logprobs is not None:
            meta.logprob_rows.append(i)
            meta.num_logprobs.append(p.logprobs)
    return meta


# byte -> its 8 bits as additive float32 masks: 0.0 where the bit allows the token, -inf where not
_BYTE_MASKS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                     bitorder="little") == 1, 0.0, -np.inf).astype(np.float32)


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: each `rows[i]` of `logits` [S, V] keeps only the tokens that row i of
    `bitmask` (int32 [len(rows), ceil(V / 32)], bit j of word w = token 32 w + j) allows; the
    rest become -inf, so that every later stage (penalties, temperature, top-k/p, greedy,
    logprobs) sees the masked logits. One table lookup per mask byte, one add per row."""
    n, V = len(rows), logits.shape[1]
    add = np.take(_BYTE_MASKS, bitmask.view(np.uint8), axis=0).reshape(n, -1)[:, :V]
    if n == logits.shape[0] and rows == list(range(n)):
        logits.add_(torch.from_numpy(add).to(logits.device))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits.index_add_(0, index, torch.from_numpy(add).to(logits.device))


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, L] padded ids -> [S, V] occurrence counts (padding falls in a dropped column)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's order: repetition (prompt + output), then frequency and presence (output only)."""
    V = meta.vocab_size
    out_counts = _bin_counts(meta.output_token_ids, V)
    if meta.repetition_penalty is not None:
        seen = (_bin_counts(meta.prompt_token_ids, V) > 0) | (out_counts > 0)
        pen = torch.where(seen, meta.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / pen, logits * pen)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty.unsqueeze(1) * out_counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int = 0) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k, then outside its top-p nucleus."""
    V = logits.shape[1]
    if top_p is None:
        # top-k alone needs only the k-th largest value per row, not a full sort.
        max_k = max_top_k or V
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= V).unsqueeze(1), float("-inf"))  # rows without top-k
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (V - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1), is a draw from p. A seeded row draws its q
    from its own CPU generator, so its tokens do not depend on the rest of the batch."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    if generators:
        V = probs.shape[1]
        own = torch.stack([torch.empty(V).exponential_(generator=g) for g in generators.values()])
        q[list(generators)] = own.to(q.device)
    # q == 0 would turn a filtered (zero) probability into NaN, which argmax prefers.
    return probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


LOGPROB_FLOOR = -9999.0


def gather_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor,
                    meta: SamplingMetadata) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model distribution: the sampled token, then the top-N."""
    out: list[TokenLogprobs | None] = [None] * meta.num_rows
    rows = torch.tensor(meta.logprob_rows, device=raw_logits.device)
    # a token a grammar masked has logprob -inf: reported as -9999.0 (vLLM's value), since JSON
    # has no infinity
    logprobs = raw_logits[rows].log_softmax(dim=-1).clamp_min_(LOGPROB_FLOOR)
    chosen = sampled[rows].unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    max_n = max(meta.num_logprobs)
    top_lp, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (logprobs[:, :0], chosen[:, :0])
    ids = torch.cat([chosen, top_ids], dim=1).tolist()
    lps = torch.cat([chosen_lp, top_lp], dim=1).tolist()
    for j, (row, n) in enumerate(zip(meta.logprob_rows, meta.num_logprobs)):
        out[row] = TokenLogprobs(token_ids=ids[j][:n + 1], logprobs=lps[j][:n + 1],
                                 sampled_rank=int(ranks[j]))
    return out


class Sampler:
    """Turns [S, V] logits into one token per row (plus logprobs where asked)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw = logits.float()
        if meta.all_greedy and meta.no_penalties and meta.banned_tokens is None \
                and meta.bias_tokens is None and not meta.logprob_rows:
            return SamplerOutput(raw.argmax(dim=-1).tolist(), [None] * meta.num_rows)

        logits = self.adjust(raw, meta)
        greedy = logits.argmax(dim=-1) if not meta.all_random else None
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = random_sample(self.probs(logits, meta), meta.generators)
            if greedy is not None:
                sampled = torch.where(meta.greedy_mask, greedy, sampled)

        logprobs = gather_logprobs(raw, sampled, meta) if meta.logprob_rows \
            else [None] * meta.num_rows
        return SamplerOutput(sampled.tolist(), logprobs)

    @staticmethod
    def adjust(raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logit bias, penalties and min_tokens' bans (out of place); greedy takes the argmax
        of these."""
        logits = raw
        if meta.bias_tokens is not None:  # out of place: the caller's logits stay as they were
            logits = logits.index_put((meta.bias_rows, meta.bias_tokens), meta.bias_values,
                                      accumulate=True)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        if meta.banned_tokens is not None:
            banned = logits.index_put((meta.banned_rows, meta.banned_tokens),
                                      torch.tensor(float("-inf"), device=logits.device))
            if meta.grammar_masked:
                # a grammar that allows only EOS ends the output even before min_tokens: a row
                # with no token left keeps its unbanned logits (only a grammar empties a row)
                rows = meta.banned_rows.unique()
                dead = rows[torch.isneginf(banned[rows]).all(dim=-1)]
                if len(dead):
                    banned[dead] = logits[dead]
            logits = banned
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: adjusted logits through temperature,
        top-k / top-p and min-p, softmaxed (not all_greedy batches only)."""
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        return logits.softmax(dim=-1)
