"""Shared fixtures: the default model, and Hugging Face's greedy reference on it."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # test helper modules import by plain name
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "東京は日本の首都です。東京について教えてください。",
    "Emoji party 🎉🚀👍🏽! Describe this feeling:",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:\n1.",
    "Q: What is 12 times 12?\nA:",
    ("In computing, a cache is a hardware or software component that stores data so that future "
     "requests for that data can be served faster; the data stored in a cache might be the result "
     "of an earlier computation or a copy of data stored elsewhere. A cache hit occurs when the "
     "requested data can be found in a cache, while a cache miss occurs when it cannot. Cache hits "
     "are served by reading data from the cache, which is faster than recomputing a result or "
     "reading from a slower data store; thus, the more requests that can be served from the cache, "
     "the faster the system performs. To be cost-effective, caches must be relatively small. "
     "Summarize the paragraph above in one sentence:"),
    "Hi",
]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from kvflow.model_path import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from kvflow.tokenizer import get_tokenizer
    return get_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def prompt_ids(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(p) for p in PROMPTS]


def hf_greedy_reference(model_path: str, prompt_ids: list[list[int]], dtype, round_to=None) -> list:
    """HF transformers on the same GGUF in `dtype`: greedy tokens and top-3 ids per position;
    `round_to`: the matrices' values rounded to that dtype first (what kvflow's weight_dtype
    does at load)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    folder, fname = os.path.split(model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype)
    model.eval()
    if round_to is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.copy_(p.to(round_to).to(dtype))
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
            tokens = out.sequences[0, len(ids):].tolist()
            top3 = [s[0].topk(3).indices.tolist() for s in out.scores]
            refs.append((tokens, top3))
    del model
    return refs


@pytest.fixture(scope="session")
def hf_reference(default_model_path, prompt_ids):
    """HF transformers, fp32, same GGUF: greedy tokens and the top-3 ids at every position."""
    import torch
    return hf_greedy_reference(default_model_path, prompt_ids, torch.float32)


# How many leading tokens must equal HF's before a divergence is excused as an fp tie: a model
# that diverges at once would otherwise pass on "first token in the top-3" alone.
MIN_AGREE_FP32 = NEW_TOKENS // 2
MIN_AGREE_BF16 = 4


def agreeing_prefix(got: list[int], tokens: list[int]) -> int:
    """How many leading tokens are equal."""
    return next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))


def assert_matches_reference(got: list[int], ref: tuple[list[int], list[list[int]]], label: str,
                             min_agree: int = MIN_AGREE_FP32) -> None:
    """Token-identical; or the first `min_agree` tokens identical and, at the first divergence,
    our token in HF's top-3 (past it the contexts differ, so the comparison stops)."""
    tokens, top3 = ref
    assert len(got) == len(tokens), f"{label}: {len(got)} tokens, HF made {len(tokens)}"
    j = agreeing_prefix(got, tokens)
    if j == len(tokens):
        return
    assert j >= min_agree, f"{label}: diverged at {j}, before the floor of {min_agree} equal tokens"
    assert got[j] in top3[j], f"{label}: diverged at {j}: {got[j]} not in HF top-3 {top3[j]}"


def assert_follow_reference(outs, refs, min_identical: int, what: str,
                            min_agree: int = MIN_AGREE_BF16) -> None:
    """Every output matches its reference (or leaves it for one of the top-3 after `min_agree`
    equal tokens), and at least `min_identical` of them are token-identical to it."""
    identical = 0
    for i, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, refs[i], f"prompt {i}", min_agree)
        identical += out.outputs[0].token_ids == refs[i][0]
    assert identical >= min_identical, f"only {identical} prompts kept {what}'s exact tokens"
