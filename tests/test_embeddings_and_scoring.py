"""Embeddings and prompt logprobs on the default model (fp32, the GGUF dequantised) equal
Hugging Face transformers' on the same weights: offline in chunks of 16 tokens with prefix
caching on, and through a real `kvflow serve` (the openai client's embeddings, vLLM's
prompt_logprobs and OpenAI's echo scoring) whose prompts run whole; embeddings of a tiny
random Llama equal HF's for every pooling type."""
from __future__ import annotations

import asyncio
import base64
import os

import httpx
import numpy as np
import openai
import pytest
import torch

from conftest import PROMPTS
from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3
from server_helpers import ServerProcess, assert_server_clean
from kvflow import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.slow  # loads models, starts a server

TOP_N = 3
LOGPROB_ATOL = 2e-3  # fp32 against fp32: different kernels and summation orders
SCORED = [0, 2, 3, 7, 8]  # short, CJK, emoji, the long paragraph (several chunks), "Hi"


@pytest.fixture(scope="module")
def prompts(prompt_ids):
    return [prompt_ids[i] for i in SCORED]


@pytest.fixture(scope="module")
def hf(default_model_path, prompts):
    """HF's final-normed hidden states and log-softmax of each prompt, one forward each."""
    from transformers import AutoModelForCausalLM
    folder, fname = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()
    refs = {}
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state  # after the final norm
            logits = model.lm_head(hidden)[0].float()
            refs[tuple(ids)] = (hidden[0].float(), logits.log_softmax(dim=-1))
    del model
    return refs


@pytest.fixture(scope="module")
def llm(default_model_path):
    """Chunks of 16 tokens; MEAN pooling, which sums its rows across the chunks."""
    return LLM(default_model_path, dtype="float32", quantization="none", max_model_len=512,
               num_blocks=128, max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
                        "--num-blocks", "256")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def pooled(hidden, pooling_type, normalize=True):
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                 torch.as_tensor(b, dtype=torch.float32), dim=0).item()


def assert_prompt_logprobs_equal_hf(got, ids, ref, label, top_n=TOP_N):
    """`got`: vLLM's shape, None then {token id: Logprob} for each later position."""
    assert len(got) == len(ids) and got[0] is None, label
    for p in range(1, len(ids)):
        d, row = got[p], ref[p - 1]
        assert ids[p] in d, f"{label}: position {p} lacks the prompt's token"
        assert abs(d[ids[p]].logprob - row[ids[p]].item()) < LOGPROB_ATOL, f"{label}: position {p}"
        rank = int((row > row[ids[p]]).sum()) + 1
        assert abs(row.sort(descending=True).values[d[ids[p]].rank - 1] - row[ids[p]]) < LOGPROB_ATOL
        assert abs(d[ids[p]].rank - rank) <= 2 or rank > 100, f"{label}: position {p}"
        top = row.topk(top_n)
        for tok, value in zip(top.indices.tolist(), top.values.tolist()):
            if tok in d:
                assert abs(d[tok].logprob - value) < LOGPROB_ATOL, f"{label}: position {p}"
            else:  # a near tie at the edge of the top-N
                assert abs(top.values[-1] - value) < LOGPROB_ATOL, f"{label}: position {p}"
        assert len(d) in (top_n, top_n + 1)


# -- offline, chunked -----------------------------------------------------------------------
def test_mean_embeddings_over_chunks_equal_hf(llm, hf, prompts):
    assert max(map(len, prompts)) > 16 * 4, "the long prompt needs several chunks"
    outs = llm.embed(prompts, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.prompt_token_ids == ids
        assert cosine(out.outputs.embedding, pooled(hf[tuple(ids)][0], "MEAN")) >= 0.999
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-4
    kv = llm.engine.core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_normalize_false_per_request_gives_the_raw_mean(llm, hf, prompts):
    out = llm.embed(prompts[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    ref = pooled(hf[tuple(prompts[0])][0], "MEAN", normalize=False)
    got = torch.tensor(out.outputs.embedding)
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-3)
    assert abs(got.norm().item() - 1) > 0.1


def test_prompt_logprobs_over_chunks_equal_hf(llm, hf, prompts):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP_N)
    for i, (ids, out) in enumerate(zip(prompts, llm.generate(prompts, params, use_tqdm=False))):
        assert_prompt_logprobs_equal_hf(out.prompt_logprobs, ids, hf[tuple(ids)][1], f"prompt {i}")
        assert len(out.outputs[0].token_ids) == 2


def test_prompt_logprobs_after_the_prompt_is_cached_are_computed_again(llm, hf, prompts):
    ids = max(prompts, key=len)
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids], plain, use_tqdm=False)  # its full blocks are now cached
    assert llm.generate([ids], plain, use_tqdm=False)[0].num_cached_tokens >= len(ids) - 16
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scored = llm.generate([ids], params, use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    assert_prompt_logprobs_equal_hf(scored.prompt_logprobs, ids, hf[tuple(ids)][1],
                                    "after a cache hit", top_n=1)
    assert llm.generate([ids], params, use_tqdm=False)[0].prompt_logprobs == scored.prompt_logprobs


def test_n_samples_share_one_prompt_scoring(llm, prompts):
    out = llm.generate([prompts[0]], SamplingParams(n=3, max_tokens=2, prompt_logprobs=0, seed=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(prompts[0])
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])


def test_generation_and_embedding_requests_share_steps(llm, prompts, monkeypatch):
    engine = llm.engine
    scheduler = engine.core.scheduler
    steps = []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append(set(out.num_scheduled_tokens))
        return out
    monkeypatch.setattr(scheduler, "schedule", recording)
    engine.add_request("gen", prompts[3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.add_pooling_request("emb", prompts[1], PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert {"gen", "emb"} in steps and set(done) == {"gen", "emb"}
    assert len(done["gen"].outputs[0].token_ids) == 4
    alone = llm.embed(prompts[1], use_tqdm=False)[0].outputs.embedding
    assert cosine(done["emb"].outputs.embedding, alone) > 0.99999


# -- the server, unchunked --------------------------------------------------------------------
def test_server_embeddings_equal_hf_float_and_base64(client, hf, prompts, default_tokenizer):
    texts = [PROMPTS[i] for i in SCORED]
    assert [default_tokenizer.encode(t) for t in texts] == prompts
    model = client.models.list().data[0].id
    as_float = client.embeddings.create(model=model, input=texts, encoding_format="float")
    assert as_float.object == "list" and as_float.usage.prompt_tokens == sum(map(len, prompts))
    for item, ids in zip(as_float.data, prompts):
        assert item.object == "embedding"
        assert cosine(item.embedding, pooled(hf[tuple(ids)][0], "LAST")) >= 0.999
    as_b64 = client.embeddings.create(model=model, input=texts, encoding_format="base64")
    for a, b in zip(as_float.data, as_b64.data):  # (batches may differ: fp32 rounding only)
        assert np.allclose(np.frombuffer(base64.b64decode(b.embedding), dtype="<f4"),
                           np.array(a.embedding, dtype=np.float32), atol=1e-5)
    # the SDK's default asks for base64 and decodes it; token ids work as input too
    by_ids = client.embeddings.create(model=model, input=prompts[:2])
    assert [i.index for i in by_ids.data] == [0, 1]
    assert np.allclose(by_ids.data[1].embedding, as_float.data[1].embedding, atol=1e-6)


def test_server_prompt_logprobs_equal_hf(server, hf, prompts):
    ids = prompts[3]
    resp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": TOP_N})
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["prompt_logprobs"]
    from kvflow.outputs import Logprob
    as_dicts = [None if d is None else {int(t): Logprob(**v) for t, v in d.items()} for d in got]
    assert_prompt_logprobs_equal_hf(as_dicts, ids, hf[tuple(ids)][1], "server")


def test_echo_with_max_tokens_zero_scores_the_prompt(client, hf, prompts):
    """lm-evaluation-harness's loglikelihood request."""
    text, ids = PROMPTS[SCORED[3]], prompts[3]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=text,
                                    max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    ref = hf[tuple(ids)][1]
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < LOGPROB_ATOL
        assert abs(max(lp.top_logprobs[p].values()) - ref[p - 1].max().item()) < LOGPROB_ATOL
    assert "".join(lp.tokens) == text and lp.text_offset == sorted(lp.text_offset)


def test_echo_scoring_streams_the_same_answer(client):
    text = PROMPTS[SCORED[0]]
    kw = dict(model=client.models.list().data[0].id, prompt=text, max_tokens=0, echo=True,
              logprobs=1, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text == text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == \
        whole.logprobs.token_logprobs
    assert chunks[-1].finish_reason == "length"


def test_echo_with_logprobs_covers_prompt_then_output(client, prompts):
    text = PROMPTS[SCORED[0]]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=text,
                                    max_tokens=4, echo=True, logprobs=2, temperature=0)
    choice, lp = out.choices[0], out.choices[0].logprobs
    n = len(prompts[0])
    assert choice.text.startswith(text) and len(lp.tokens) == n + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[n] == len(text) and "".join(lp.tokens) == choice.text


def test_generation_and_embeddings_interleave_on_one_server(server, client, prompts):
    model = client.models.list().data[0].id
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                 timeout=120)
    long_text = PROMPTS[SCORED[3]]

    async def run():
        gens = [aclient.completions.create(model=model, prompt=PROMPTS[i], max_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True})
                for i in (0, 4, 5)]
        embs = [aclient.embeddings.create(model=model, input=[long_text, PROMPTS[i]])
                for i in range(6)]
        return await asyncio.gather(*gens, *embs)
    results = asyncio.run(run())
    assert all(len(r.choices[0].text) > 0 and r.usage.completion_tokens == 24 for r in results[:3])
    assert all(len(r.data) == 2 and len(r.data[0].embedding) == 576 for r in results[3:])
    first = np.array(results[3].data[0].embedding)
    assert all(np.allclose(r.data[0].embedding, first, atol=1e-5) for r in results[3:])


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[1, 2], [49152]]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": list(range(600))}, "input"),  # over max_model_len
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(server, body, param):
    resp = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
])
def test_bad_scoring_requests_are_400s_naming_the_field(server, body, param):
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert_server_clean(server)


def test_chat_prompt_logprobs_equal_the_completions_of_its_rendered_prompt(server):
    """vLLM's shape: `prompt_logprobs` beside the choices, one entry per prompt token of the
    rendered chat, the first None; the same numbers /v1/completions gives for those ids."""
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
    assert chat.status_code == 200, chat.text
    got = chat.json()["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert all(str(t) in d for t, d in zip(ids[1:], got[1:]))
    comp = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
    ref = comp.json()["choices"][0]["prompt_logprobs"]
    for p, (a, b) in enumerate(zip(got, ref)):
        assert (a is None) == (b is None), p
        if a is not None:
            assert a.keys() == b.keys(), p
            assert all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-4 and
                       a[t]["rank"] == b[t]["rank"] for t in a), p
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 1, "temperature": 0})
    assert "prompt_logprobs" not in plain.json()
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
    assert_server_clean(server)


# -- a tiny random Llama ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_llama3(path)
    save_byte_tokenizer(path)
    return path


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_tiny_llama_embeddings_equal_hf(tiny_llama, pooling_type):
    from transformers import LlamaForCausalLM
    hf_model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_blocks=64,
              max_num_batched_tokens=8, pooler_config={"pooling_type": pooling_type})
    prompts = [[(7 * i + k) % 300 + 5 for i in range(n)] for k, n in enumerate((1, 5, 23, 40))]
    for ids, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
        assert cosine(out.outputs.embedding, pooled(hidden, pooling_type)) >= 0.999


def test_prompt_logprobs_survive_a_preemption_mid_prompt(tiny_llama, tmp_path):
    """A request preempted in the middle of its prompt computes it again from the start; its
    prompt logprobs are each position's once, and equal HF's."""
    import json
    from transformers import LlamaForCausalLM
    hf_model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    trace = tmp_path / "trace.jsonl"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_blocks=9, block_size=16,
              max_num_batched_tokens=8, trace=str(trace))
    short = [(5 * i + 3) % 300 + 5 for i in range(30)]
    long = [(11 * i + 7) % 300 + 5 for i in range(100)]
    outs = llm.generate([short, long], [
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)],
        use_tqdm=False)
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    computed = 0  # of the long prompt, when it was preempted
    for s in steps:
        if "1" in s["preempted"]:
            break
        computed = max([computed] + [r["num_computed_tokens"] + r["tokens"]
                                     for r in s["requests"] if r["id"] == "1"])
    else:
        raise AssertionError("the small pool should preempt the long prompt")
    assert 0 < computed < len(long), "preempted in the middle of its prompt"
    with torch.no_grad():
        ref = hf_model(torch.tensor([long])).logits[0].float().log_softmax(dim=-1)
    got = outs[1].prompt_logprobs
    assert len(got) == len(long) and got[0] is None
    for p in range(1, len(long)):
        assert abs(got[p][long[p]].logprob - ref[p - 1, long[p]].item()) < 1e-4
        assert set(got[p]) - {long[p]} <= set(ref[p - 1].topk(3).indices.tolist())


def test_speculative_decoding_refuses_prompt_logprobs_but_serves_embeddings(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="prompt_logprobs.*speculative"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    prompt = [5, 6, 7, 8] * 6  # repeats: n-gram drafts for the decoding request
    engine = llm.engine
    engine.add_request("gen", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_pooling_request("emb", prompt, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(done["gen"].outputs[0].token_ids) == 12
    alone = llm.embed(prompt, use_tqdm=False)[0].outputs.embedding
    assert cosine(done["emb"].outputs.embedding, alone) > 0.99999


def test_gemma3_sliding_window_embeddings_and_prompt_logprobs_equal_hf(tmp_path):
    """A model with sliding-window layers (one block table per KV cache group) and a soft-capped
    LM head: MEAN pooling and prompt logprobs over chunks of 8, against transformers."""
    from transformers import Gemma3ForCausalLM
    from window_model_helpers import save_tiny_gemma3
    path = str(tmp_path)
    save_tiny_gemma3(path)
    save_byte_tokenizer(path)
    hf_model = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=256, num_blocks=64, max_num_batched_tokens=8,
              pooler_config={"pooling_type": "MEAN"})
    ids = [(7 * i + 3) % 300 + 5 for i in range(30)]
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    emb = llm.embed(ids, use_tqdm=False)[0].outputs.embedding
    assert cosine(emb, pooled(hidden, "MEAN")) >= 0.999
    got = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    for p in range(1, len(ids)):
        assert abs(got.prompt_logprobs[p][ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-4
