"""Rejection sampling keeps the target's distribution: over many seeded trials, the tokens a
request emits with drafts are distributed as the exact softmax of the target's (processed)
logits, checked by chi-square; greedy rows give the target's argmax run; logprobs are the
target's."""
from __future__ import annotations

import math

import pytest
import torch

from kvflow.model.rejection_sampler import rejection_sample
from kvflow.model.sampler import SamplingRow, build_sampling_metadata
from kvflow.sampling_params import SamplingParams

V = 10


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` against `probs` (cells with expected < 5 pooled)."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def run_trials(logits: torch.Tensor, drafts: list[int], params: SamplingParams, trials: int):
    """One batch of `trials` requests, each with the same logits rows and drafts and its own
    seeded generator: what each emitted."""
    k = len(drafts)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(trials)]
    rows = [SamplingRow(params, [], [], g) for g in gens for _ in range(k + 1)]
    meta = build_sampling_metadata(rows, V)
    out, _ = rejection_sample(logits.repeat(trials, 1), meta, [drafts] * trials,
                              [params.greedy] * trials, gens)
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=6)])
def test_random_sampling_with_drafts_keeps_the_target_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5  # a target's rows after the known token and 2 drafts
    probs = torch.stack([
        (logits[i] / params.temperature).softmax(-1) for i in range(3)])
    if params.top_k > 0:  # the exact nucleus the sampler keeps
        for i in range(3):
            kth = logits[i].topk(params.top_k).values[-1]
            p = torch.where(logits[i] >= kth, probs[i], 0.0)
            probs[i] = p / p.sum()
    # drafts: a likely token, then an unlikely one (so both accept and reject paths run)
    d0 = int(probs[0].argsort(descending=True)[1])
    d1 = int(probs[1].argsort(descending=True)[3])
    out = run_trials(logits, [d0, d1], params, 6000)

    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V)
    assert chi_square_p(first, probs[0]) > 1e-3
    # given the first token was the draft, the second follows the target's next row
    second = torch.bincount(torch.tensor([o[1] for o in out if o[0] == d0]), minlength=V)
    assert second.sum() > 500
    assert chi_square_p(second, probs[1]) > 1e-3
    # an accepted run of both drafts is followed by a bonus token from the last row
    third = torch.bincount(torch.tensor([o[2] for o in out if o[:2] == [d0, d1]]), minlength=V)
    if third.sum() >= 50:
        assert chi_square_p(third, probs[2]) > 1e-3
    # and the test can fail: the draft's own one-hot is far from the target's
    wrong = torch.zeros(V)
    wrong[d0] = 1.0
    assert chi_square_p(first, 0.5 * wrong + 0.5 * probs[0]) < 1e-6


def test_seeded_requests_reproduce_their_tokens():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    a = run_trials(logits, [1, 2, 3], SamplingParams(temperature=1.0), 50)
    b = run_trials(logits, [1, 2, 3], SamplingParams(temperature=1.0), 50)
    assert a == b and len({tuple(x) for x in a}) > 1


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([4, 7, 1, 2]):
        logits[i, t] = 5.0
    p = SamplingParams(temperature=0.0)
    meta = build_sampling_metadata([SamplingRow(p, [], [])] * 4 + [SamplingRow(p, [], [])] * 2, V)
    both = torch.cat([logits, logits[:2]])
    out, _ = rejection_sample(both, meta, [[4, 7, 9], [5]], [True, True], [None, None])
    assert out == [[4, 7, 1], [4]]  # two accepted then the target's; none accepted then its own
    meta = build_sampling_metadata([SamplingRow(p, [], [])] * 4, V)
    out, _ = rejection_sample(logits, meta, [[4, 7, 1]], [True], [None])
    assert out == [[4, 7, 1, 2]]  # all accepted: the bonus token


def test_logprobs_are_the_targets_at_each_emitted_token():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    p = SamplingParams(temperature=0.0, logprobs=2)
    meta = build_sampling_metadata([SamplingRow(p, [], [])] * 3, V)
    draft = [int(logits[0].argmax())] + [int(logits[1].argmin())]
    out, lps = rejection_sample(logits, meta, [draft], [True], [None])
    assert out == [[draft[0], int(logits[1].argmax())]]
    ref = logits.log_softmax(-1)
    assert len(lps[0]) == 2
    for i, (tok, lp) in enumerate(zip(out[0], lps[0])):
        assert lp.token_ids[0] == tok
        assert math.isclose(lp.logprobs[0], ref[i, tok].item(), rel_tol=1e-5)
        assert lp.token_ids[1:] == ref[i].topk(2).indices.tolist()
