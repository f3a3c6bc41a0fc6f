"""`kvflow bench serve` prompt sets: fresh per rate and for the warm-up, reproducible by seed."""
import argparse
import math

from kvflow.entrypoints.bench_serve import _prompt_sets


def args(**kw) -> argparse.Namespace:
    base = dict(warmup=2, request_rate=[1.0, 4.0, math.inf], prompt_format="ids",
                endpoint="completions", vocab_size=32000, num_prompts=5, input_len=12, seed=0)
    return argparse.Namespace(**{**base, **kw})


def test_every_rate_and_warmup_gets_its_own_prompts():
    warm, runs = _prompt_sets(args())
    assert [len(w) for w in warm] == [2, 2, 2] and [len(r) for r in runs] == [5, 5, 5]
    every = [tuple(p) for group in warm + runs for p in group]
    assert len(set(every)) == len(every) == 21  # no prompt repeats, so no prefix-cache hits
    assert all(len(p) == 12 and all(100 <= t < 32000 - 100 for t in p) for p in every)


def test_same_seed_same_prompts_other_seed_other_prompts():
    assert _prompt_sets(args()) == _prompt_sets(args())
    assert _prompt_sets(args())[1][0] != _prompt_sets(args(seed=1))[1][0]


def test_no_warmup():
    warm, runs = _prompt_sets(args(warmup=0, request_rate=[2.0]))
    assert warm == [[]] and len(runs[0]) == 5
