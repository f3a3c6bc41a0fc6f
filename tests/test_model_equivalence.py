"""kvflow's Llama-family forward over a flat, paged batch gives Hugging Face's logits."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest_model_helpers import PagedDriver, hf_logits, save_tiny_llama3, save_tiny_qwen2
from kvflow.model.loader import load_model
from kvflow.model_path import default_model_path

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

torch.set_num_threads(1)
ATOL = 1e-4
SEQ_LENS = {"a": 11, "b": 23, "c": 1, "d": 6}
DECODE_STEPS = 4


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def models(request, tmp_path_factory):
    """(kvflow model, HF model, token ids per sequence incl. teacher-forced decode tokens)."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp(request.param))
    {"llama3": save_tiny_llama3, "qwen2": save_tiny_qwen2}[request.param](path)
    model, arch = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    tokens = {sid: rng.integers(0, arch.vocab_size, n + DECODE_STEPS).tolist() for sid, n in SEQ_LENS.items()}
    refs = {sid: hf_logits(hf, ids) for sid, ids in tokens.items()}
    return model, arch, tokens, refs


def _check(logits: torch.Tensor, ref: torch.Tensor, start: int) -> None:
    expected = ref[start: start + logits.shape[0]]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_flat_prefill_batch_matches_hf(models):
    model, arch, tokens, refs = models
    driver = PagedDriver(model, arch, seed=3)
    out = driver.step([(sid, tokens[sid][:n]) for sid, n in SEQ_LENS.items()])
    for sid in SEQ_LENS:
        _check(out[sid], refs[sid], 0)


def test_chunked_prefill_mixed_with_decodes_matches_hf(models):
    model, arch, tokens, refs = models
    driver = PagedDriver(model, arch, seed=7)
    # c and d finish their prompts first and then decode while a and b arrive in chunks
    plan_steps = [
        {"c": 1, "d": 6, "b": 5},
        {"c": 1, "d": 1, "a": 4, "b": 9},
        {"b": 1, "c": 1, "a": 3, "d": 1},
        {"a": 4, "b": 8, "d": 1},
        {"a": 1, "b": 1, "c": 1},
    ]
    done = dict.fromkeys(SEQ_LENS, 0)
    for step in plan_steps:
        plan = [(sid, tokens[sid][done[sid]: done[sid] + n]) for sid, n in step.items()]
        out = driver.step(plan)
        for sid, n in step.items():
            _check(out[sid], refs[sid], done[sid])
            done[sid] += n
    assert done == {"a": 12, "b": 24, "c": 4, "d": 9}
    assert any(len(set(np.diff(t))) > 1 for t in driver.block_tables.values()), "blocks should be scattered"


def test_decode_steps_after_prefill_match_hf(models):
    model, arch, tokens, refs = models
    driver = PagedDriver(model, arch, seed=11)
    driver.step([(sid, tokens[sid][:n]) for sid, n in SEQ_LENS.items()])
    for i in range(DECODE_STEPS):
        order = list(SEQ_LENS)[i % 2::1] + list(SEQ_LENS)[: i % 2]  # batch order changes between steps
        out = driver.step([(sid, [tokens[sid][SEQ_LENS[sid] + i]]) for sid in order])
        for sid in order:
            _check(out[sid], refs[sid], SEQ_LENS[sid] + i)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    model, arch = load_model(path, torch.float32)
    return model, arch, hf


def test_default_gguf_model_matches_hf_gguf_load(smollm2):
    model, arch, hf = smollm2
    prompt = [1, 504, 3458, 282, 4194, 314, 253, 1345, 28, 7, 3066, 2114, 30, 216]
    ref = hf_logits(hf, prompt)
    driver = PagedDriver(model, arch, num_blocks=16, block_size=4)
    out = driver.step([("p", prompt[:9])])["p"]
    out = torch.cat([out, driver.step([("p", prompt[9:])])["p"]])
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
    assert out[-1].argmax() == ref[-1].argmax()
