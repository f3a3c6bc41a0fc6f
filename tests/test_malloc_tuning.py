"""The engine reuses the memory its forward frees: a repeated prefill takes no fresh pages
(kvflow/model/malloc_tuning.py), and KVFLOW_MALLOC_TUNING=0 restores glibc's own behaviour."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

# Each of four steps prefills four 512-token prompts (the default 2,048-token budget) and
# allocates ~1.7 GiB of fp32 activations over its 30 layers, in buffers of many sizes (the script pins fp32: "auto"
# is bf16 on CPUs with native bf16, with half the bytes; float weights, not the quantized
# default, whose scratch buffers change the pattern). The KV pool is just large enough for
# the four, so every step reuses the same cache pages and what a later step faults in is
# activation memory.
SCRIPT = r"""
import json, resource, sys
from kvflow import LLM, SamplingParams
from kvflow.model import malloc_tuning
llm = LLM(sys.argv[1], dtype="float32", quantization="none", max_model_len=1024, num_blocks=136,
          enable_prefix_caching=False)
prompts = [list(range(1000 + 600 * i, 1512 + 600 * i)) for i in range(4)]
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, params, use_tqdm=False)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "tuned": malloc_tuning._done}))
"""


def _prefill_page_faults(model_path: str, tuning: str) -> dict:
    # KV pages faulted in by the populator thread would count too: it is off here
    env = dict(os.environ, KVFLOW_MALLOC_TUNING=tuning, KVFLOW_NUM_THREADS="1", KVFLOW_KV_POPULATE="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT, model_path], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_repeated_prefill_reuses_freed_memory(default_model_path):
    tuned = _prefill_page_faults(default_model_path, "1")
    untuned = _prefill_page_faults(default_model_path, "0")
    # Tuned, the later steps run in memory the earlier ones left behind. The heap can still
    # grow where its free space is fragmented: by one 12 MiB activation at step 2 or 3 in about
    # one run of five (1,177-3,073 faults), by 5,377 pages at step 4 on an AVX2 CPU, by 9,216
    # (one and a half gate/up outputs) at step 3 in another AVX2 run. So of steps 3 and 4 one
    # must take no fresh pages, and neither more than a twentieth of what an untuned step that
    # hands its memory back faults in again (~440,000 pages): 22,000.
    assert tuned["tuned"], tuned
    assert min(tuned["faults"][2:]) < 500 and max(tuned["faults"][2:]) <= 22_000, tuned
    # The opt-out leaves glibc alone. Its own dynamic mmap threshold makes the untuned counts
    # a lottery (one commit, one hash seed: steps 2-4 at ~435k faults each in some runs, 0-19k
    # in others), so they are not asserted.
    assert not untuned["tuned"], untuned
