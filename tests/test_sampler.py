"""The batched sampler: greedy, penalties, min_tokens, filters, seeded draws, logprobs."""
import pytest
import torch

from kvflow.model.sampler import Sampler, SamplingRow, build_sampling_metadata
from kvflow.sampling_params import SamplingParams

torch.set_num_threads(1)
V = 16
EOS = 3


def row(prompt=(1, 2), output=(), eos=EOS, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen, (eos,) if eos is not None else ())


def sample(logits, rows):
    return Sampler()(logits, build_sampling_metadata(rows, logits.shape[1]))


def random_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = sample(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_1_and_zero_temperature_equal_greedy_in_a_mixed_batch():
    logits = random_logits(4, seed=1)
    rows = [row(top_k=1, temperature=1.5), row(temperature=0.0, top_p=0.5),
            row(temperature=1.0), row(top_k=1, seed=7)]
    for _ in range(5):
        out = sample(logits, rows).sampled_token_ids
        assert [out[0], out[1], out[3]] == logits[[0, 1, 3]].argmax(-1).tolist()


def seeded_tokens(logits_for_seeded: torch.Tensor, position: int, others: list, steps: int = 6):
    """Tokens a seed=42 request draws over several steps at `position` among `others`."""
    seeded = row(seed=42, temperature=1.0)
    tokens = []
    for step in range(steps):
        batch = others[:position] + [seeded] + others[position:]
        logits = random_logits(len(batch), seed=100 + step)
        logits[position] = logits_for_seeded[step]
        tokens.append(sample(logits, batch).sampled_token_ids[position])
    return tokens


def test_seeded_request_is_reproducible_across_batch_compositions():
    flat = torch.zeros(6, V)  # uniform distribution: the draw depends on the seed alone
    alone = seeded_tokens(flat, 0, [])
    mixed = [row(temperature=0.8), row(temperature=0.0), row(seed=5, top_p=0.9), row(top_k=4)]
    assert seeded_tokens(flat, 2, mixed) == alone
    assert seeded_tokens(flat, 4, mixed) == alone
    assert seeded_tokens(flat, 1, mixed[:2]) == alone
    assert len(set(alone)) > 1  # uniform over 16 tokens: six equal draws would be a broken sampler


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(1, 1000)
    draws = {}
    for seed in (1, 2):
        r = row(seed=seed)
        draws[seed] = [sample(logits, [r]).sampled_token_ids[0] for _ in range(5)]
    assert draws[1] != draws[2]


def reference_penalties(logits, prompt, output, rep, freq, pres):
    """Straightforward per-token version of vLLM's penalty formulas."""
    out = logits.clone()
    for t in range(logits.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + pres * (count > 0)
    return out


def test_penalties_change_which_token_wins():
    logits = random_logits(3, seed=3).clamp(-2, 2)
    # Each row's raw favourite is a token the penalties should push below token 12 (or above it).
    logits[0, 5], logits[0, 12] = 6.0, 4.0   # 6 / 1.3 - 0.5 * 3 - 0.7 = 2.4 < 4
    logits[1, 4], logits[1, 12] = 5.0, 4.0   # 5 - 0.1 * 2 - 1.5 = 3.3 < 4
    logits[2, 12], logits[2, 7] = 3.5, 3.0   # 3 / 0.8 = 3.75 > 3.5 (penalty < 1 rewards repeats)
    settings = [(1.3, 0.5, 0.7), (1.0, 0.1, 1.5), (0.8, 0.0, 0.0)]
    prompts = [[1, 2, 2, 9], [7], [5, 6, 7, 8]]
    outputs = [[2, 5, 5, 5], [4, 4, 11], []]
    rows = [row(prompt=p, output=o, temperature=0.0, repetition_penalty=rep,
                frequency_penalty=freq, presence_penalty=pres, logprobs=V - 1)
            for p, o, (rep, freq, pres) in zip(prompts, outputs, settings)]
    out = sample(logits, rows)
    for i, (rep, freq, pres) in enumerate(settings):
        ref = reference_penalties(logits[i], prompts[i], outputs[i], rep, freq, pres)
        assert out.sampled_token_ids[i] == int(ref.argmax()) != int(logits[i].argmax())
        # logprobs stay those of the raw logits, not the penalised ones
        lp = out.logprobs[i]
        raw = logits[i].log_softmax(-1)
        assert lp.logprobs == pytest.approx(raw[lp.token_ids].tolist(), abs=1e-5)


def test_penalised_logits_equal_reference():
    from kvflow.model.sampler import apply_penalties
    logits = random_logits(2, seed=4)
    prompts, outputs = [[0, 1, 1], [15]], [[1, 3, 3, 3, 7], [15, 2]]
    settings = [(1.2, 0.3, 0.9), (1.7, 1.1, -0.5)]
    rows = [row(prompt=p, output=o, repetition_penalty=r, frequency_penalty=f, presence_penalty=q)
            for p, o, (r, f, q) in zip(prompts, outputs, settings)]
    got = apply_penalties(logits, build_sampling_metadata(rows, V))
    for i, (r, f, q) in enumerate(settings):
        ref = reference_penalties(logits[i], prompts[i], outputs[i], r, f, q)
        assert torch.allclose(got[i], ref, atol=1e-6)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 100.0
    logits[:, 9] = 50.0
    logits[:, 10] = 10.0
    short = row(output=[5], min_tokens=3, stop_token_ids=[9], temperature=0.0)
    short_ignore_eos = row(output=[], min_tokens=1, ignore_eos=True, temperature=0.0)
    reached = row(output=[5, 6, 7], min_tokens=3, stop_token_ids=[9], temperature=0.0)
    out = sample(logits, [short, short_ignore_eos, reached]).sampled_token_ids
    assert out == [10, 9, EOS]
    for _ in range(20):  # random rows too
        tok = sample(logits, [row(output=[], min_tokens=2, stop_token_ids=[9])]).sampled_token_ids[0]
        assert tok not in (EOS, 9)


def test_min_tokens_masks_every_eos_id_of_the_model():
    # Llama 3.1 ends on any of several ids: all of them wait for min_tokens.
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 4], logits[0, 10] = 100.0, 90.0, 10.0
    params = SamplingParams(min_tokens=2, temperature=0.0)
    r = SamplingRow(params, [1, 2], [5], None, (EOS, 4))
    assert sample(logits, [r]).sampled_token_ids == [10]
    r = SamplingRow(params, [1, 2], [5, 6], None, (EOS, 4))
    assert sample(logits, [r]).sampled_token_ids == [EOS]


@pytest.mark.parametrize("kw, allowed", [
    (dict(top_k=3), lambda p: set(p.topk(3).indices.tolist())),
    (dict(top_p=0.6), None),
    (dict(min_p=0.3), lambda p: set((p >= 0.3 * p.max()).nonzero().flatten().tolist())),
    (dict(top_k=5, top_p=0.5, temperature=0.7), None),
])
def test_filters_never_sample_a_filtered_token(kw, allowed):
    logits = random_logits(1, seed=5, vocab=8)[0] / 3
    probs = (logits / kw.get("temperature", 1.0)).softmax(-1)
    if allowed is None:  # nucleus: smallest set of most likely tokens with mass >= top_p
        order = probs.argsort(descending=True)
        if "top_k" in kw:
            order = order[:kw["top_k"]]
            probs = torch.zeros_like(probs).index_put((order,), probs[order] / probs[order].sum())
        cum = probs[order].cumsum(0)
        n = int((cum < kw["top_p"]).sum()) + 1
        allowed_ids = set(order[:n].tolist())
    else:
        allowed_ids = allowed(probs)
    assert 0 < len(allowed_ids) < 8
    # A batch of 400 identical rows, plus unfiltered rows mixed in that must reach everything.
    rows = [row(**kw) for _ in range(400)] + [row() for _ in range(400)]
    out = sample(logits.expand(800, -1).contiguous(), rows).sampled_token_ids
    assert set(out[:400]) == allowed_ids
    assert len(set(out[400:])) > len(allowed_ids)


def test_random_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0]))
    out = sample(logits.expand(4000, -1).contiguous(), [row() for _ in range(4000)]).sampled_token_ids
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.04)


def test_logprobs_hold_sampled_token_then_top_n_from_raw_logits():
    logits = random_logits(4, seed=6)
    rows = [row(logprobs=3, temperature=0.7, repetition_penalty=1.5, output=[4]),
            row(logprobs=0, temperature=0.0), row(), row(logprobs=5, seed=3)]
    out = sample(logits, rows)
    assert out.logprobs[2] is None
    for i, n in ((0, 3), (1, 0), (3, 5)):
        lp = out.logprobs[i]
        raw = logits[i].log_softmax(-1)
        sampled = out.sampled_token_ids[i]
        assert len(lp.token_ids) == len(lp.logprobs) == n + 1
        assert lp.token_ids[0] == sampled
        assert lp.token_ids[1:] == raw.topk(n).indices.tolist()
        assert lp.logprobs == pytest.approx(raw[lp.token_ids].tolist(), abs=1e-5)
        assert lp.sampled_rank == int((raw > raw[sampled]).sum()) + 1
    assert out.logprobs[1].sampled_rank == 1  # greedy picks the top token


def test_sampler_does_not_modify_the_callers_logits():
    logits = random_logits(2, seed=8)
    before = logits.clone()
    sample(logits, [row(repetition_penalty=1.4, top_p=0.5, output=[1]),
                    row(min_tokens=2, temperature=0.3, top_k=2, min_p=0.1)])
    assert torch.equal(logits, before)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one():
    logits = random_logits(4, seed=9)
    top = logits.argmax(-1).tolist()
    weakest = logits.argmin(-1).tolist()
    rows = [row(temperature=0.0, logit_bias={weakest[0]: 100}),  # greedy, forced
            row(temperature=0.0, logit_bias={top[1]: -100}),  # greedy, banned
            row(temperature=1.0, logit_bias={weakest[2]: 100.0}),  # random, forced
            row(temperature=0.0)]  # no bias: untouched in the same batch
    for _ in range(20):
        out = sample(logits, rows).sampled_token_ids
        assert out[0] == weakest[0]
        assert out[1] != top[1] and out[1] == logits[1].topk(2).indices[1].item()
        assert out[2] == weakest[2]
        assert out[3] == top[3]
    # banned for a random row: never drawn, even from a uniform distribution
    flat = torch.zeros(200, V)
    banned = row(logit_bias={t: -100 for t in range(V // 2)})
    drawn = sample(flat, [banned] * 200).sampled_token_ids
    assert min(drawn) >= V // 2


def test_logit_bias_adds_each_rows_own_bias_once():
    logits = torch.zeros(2, V)
    meta = build_sampling_metadata([row(logit_bias={1: 2.5, 4: -1.0}), row(logit_bias={1: 7.0})], V)
    assert meta.bias_rows.tolist() == [0, 0, 1]
    assert meta.bias_tokens.tolist() == [1, 4, 1]
    assert meta.bias_values.tolist() == [2.5, -1.0, 7.0]
    out = sample(logits, [row(temperature=0.0, logit_bias={1: 2.5, 4: -1.0}),
                          row(temperature=0.0, logit_bias={5: 0.5, 1: 0.25})])
    assert out.sampled_token_ids == [1, 5]
    assert torch.equal(logits, torch.zeros(2, V))  # the caller's logits are not modified
