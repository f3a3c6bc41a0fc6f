"""W1's prompts: seeded random token ids, lengths uniform in [min_len, max_len]. Standard library
only (and kvflow/__init__ imports nothing eagerly), so the benchmark workers can import it from
another engine's venv (llama.cpp's, vLLM's) and every engine gets the same prompts."""
from __future__ import annotations

import random


def make_w1(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded prompts of random token ids with lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]
