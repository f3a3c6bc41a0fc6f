"""A loaded model holds its weights once: the peak resident set of a fresh process that loads
a bf16 GGUF file stays within the file's bytes plus a fixed runtime (Python, torch, the
tokenizer, the C kernels, a small KV cache), measured in that process before the load.

The model (~280 MB of bf16 weights, SmolLM2's vocabulary so that its tokenizer fits) is big
enough that a second copy of its weights (oneDNN's beside the panels, the float weights beside
their packed copy, a mapped cache file) breaks the bound, however the runtime varies."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from load_memory import start  # noqa: E402
from write_gguf import llama_shaped  # noqa: E402

from kvflow.model_path import default_model_path  # noqa: E402

SHAPE = dict(hidden=1024, ffn=4096, layers=6, heads=16, kv_heads=4, vocab=None, rope_theta=500000.0,
             ctx=2048, eps=1e-5, tied=True)
# what a start adds besides the weights: the tokenizer, the engine, the kernels and their
# scratch, the KV cache (64 blocks x 16 tokens: 6.3 MB), the warm-up's activations, and at
# load one decoder layer's float weights (~30 MB) or the tied table's (100 MB) beside the
# packed model; measured at ~130-145 MB on a Sapphire Rapids Xeon. A second copy of the
# weights is 285 MB, of the embedding table 100 MB.
RUNTIME = 200e6


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("load_memory") / "llama-280m-bf16.gguf")
    llama_shaped(path, "BF16", default_model_path(), SHAPE)
    return path


def test_a_bf16_file_is_held_once_after_load(bf16_file, tmp_path):
    size = os.path.getsize(bf16_file)
    assert 250e6 < size < 320e6
    first = start(bf16_file, str(tmp_path / "cache"))  # converts into kvflow's cache
    again = start(bf16_file, str(tmp_path / "cache"))  # reads the cache, as every later start
    for run in (first, again):
        before = run["stages"]["imported"]["VmRSS"]
        loaded = run["stages"]["loaded"]
        print(f"peak {loaded['VmHWM'] / 1e6:.0f} MB, RSS {loaded['VmRSS'] / 1e6:.0f} MB "
              f"(file {loaded['RssFile'] / 1e6:.0f} MB), before load {before / 1e6:.0f} MB, "
              f"weights {size / 1e6:.0f} MB")
        assert loaded["VmRSS"] < before + size + RUNTIME
    # a later start: one copy at any moment of its load; the first also converts: the model
    # in bf16 with its fused projections beside it, one tensor at a time in fp32 (measured
    # 2x the weights + 230 MB; before, the whole model in fp32 and a bytes copy of it: 4.2x)
    assert again["stages"]["loaded"]["VmHWM"] < again["stages"]["imported"]["VmRSS"] + size + RUNTIME
    assert first["stages"]["loaded"]["VmHWM"] < first["stages"]["imported"]["VmRSS"] + 2.5 * size + RUNTIME
    # the start-up line says where the memory went
    line = again["startup"]
    weights = float(line.split("memory: weights ")[1].split(" MB")[0]) * 1e6
    assert abs(weights - size) < 0.05 * size, line
    assert f"KV {again['kv_bytes'] / 1e6:.0f} MB" in line and "runtime " in line and "peak " in line, line
