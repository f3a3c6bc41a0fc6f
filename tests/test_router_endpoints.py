"""Every endpoint of `kvflow serve` through `kvflow router --replicas` with two real replicas of a
tiny random Llama (fp32, greedy): embeddings, tokenize / detokenize, Anthropic's messages and the
Responses API answer as a replica asked directly does; a Responses chain stays on the replica
that stored it; LoRA adapters load and unload on every replica at once. The router round-robins,
so that a request that ignored where a response lives would land on the other replica."""
from __future__ import annotations

import os

import anthropic
import httpx
import numpy as np
import openai
import pytest

from conftest_model_helpers import _save_random
from lora_helpers import write_adapter
from server_helpers import ServerProcess
from test_router_replicas import GUARD_S, RouterProcess

pytestmark = pytest.mark.slow

REPLICA_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks", "96",
                "--max-num-seqs", "8", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("router") / "tiny-router")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(default_tokenizer), max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("router-adapters")
    write_adapter(str(root / "sql"), tiny_model, seed=1, b_scale=0.5)
    old = os.environ.get("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    a = b = router = None
    try:
        args = ["--model", tiny_model, *REPLICA_ARGS, "--lora-allowed-root", str(root)]
        a = ServerProcess(*args)
        b = ServerProcess(*args)
        router = RouterProcess("--replicas", a.url, b.url, "--policy", "round_robin",
                               "--health-check-interval-secs", "0")
        router.model_path = tiny_model
        yield router, a, b, root
    finally:
        if old is None:
            os.environ.pop("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"] = old
        for p in (router, a, b):
            if p is not None:
                p.close()


@pytest.fixture(scope="module")
def model(cluster) -> str:
    router = cluster[0]
    return httpx.get(router.url + "/v1/models").json()["data"][0]["id"]


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=GUARD_S)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=GUARD_S)


def holders(cluster, response_id: str) -> list[str]:
    """The replicas (asked directly) that hold a stored response."""
    _, a, b, _ = cluster
    return [s.url for s in (a, b)
            if httpx.get(f"{s.url}/v1/responses/{response_id}").status_code == 200]


def test_embeddings_and_tokenize_through_the_router_equal_a_replicas(cluster, model):
    router, a, b, _ = cluster
    texts = ["The router forwards embeddings.", "A second input, a little longer than the first."]
    direct = oai(a.url).embeddings.create(model=model, input=texts)
    for _ in range(2):  # round robin: one on each replica
        routed = oai(router.url).embeddings.create(model=model, input=texts)
        assert len(routed.data) == 2
        for x, y in zip(routed.data, direct.data):
            assert np.allclose(x.embedding, y.embedding, atol=1e-5)
    body = {"messages": [{"role": "user", "content": "hello"}], "model": model}
    tok = httpx.post(router.url + "/tokenize", json=body, timeout=GUARD_S)
    assert tok.status_code == 200 and tok.json() == httpx.post(a.url + "/tokenize", json=body).json()
    ids = tok.json()["tokens"]
    detok = httpx.post(router.url + "/detokenize", json={"tokens": ids}, timeout=GUARD_S)
    assert detok.status_code == 200 and "hello" in detok.json()["prompt"]
    # a replica's 400 comes back as it said it
    bad = httpx.post(router.url + "/detokenize", json={"tokens": [-1]}, timeout=GUARD_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_anthropic_messages_through_the_router_equal_a_replicas(cluster, model):
    router, a, b, _ = cluster
    ask = [{"role": "user", "content": "Name three fruits."}]
    direct = claude(a.url).messages.create(model=model, max_tokens=8, messages=ask,
                                           extra_body=GREEDY)
    for _ in range(2):
        routed = claude(router.url).messages.create(model=model, max_tokens=8, messages=ask,
                                                    extra_body=GREEDY)
        assert routed.content[0].text == direct.content[0].text
        assert routed.usage.output_tokens == direct.usage.output_tokens
    with claude(router.url).messages.stream(model=model, max_tokens=8, messages=ask,
                                            extra_body=GREEDY) as s:
        assert s.get_final_text() == direct.content[0].text
    counted = claude(router.url).messages.count_tokens(model=model, messages=ask)
    assert counted.input_tokens == direct.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:  # an error in Anthropic's shape
        claude(router.url).messages.create(model=model, max_tokens=0, messages=ask)
    assert e.value.body["type"] == "error"


def test_a_responses_chain_stays_on_the_replica_that_stored_it(cluster, model):
    router, a, b, _ = cluster
    client = oai(router.url)
    first = client.responses.create(model=model, input="Start a story.", max_output_tokens=6,
                                    **GREEDY)
    home = holders(cluster, first.id)
    assert len(home) == 1
    previous = first
    for turn in range(3):  # round robin alone would send every other turn to the other replica
        before = router.routed()
        nxt = client.responses.create(model=model, input=f"Go on ({turn}).",
                                      previous_response_id=previous.id, max_output_tokens=6,
                                      **GREEDY)
        assert nxt.previous_response_id == previous.id
        sent = {u: n - before.get(u, 0) for u, n in router.routed().items()}
        assert {u: n for u, n in sent.items() if n} == {home[0]: 1}
        assert holders(cluster, nxt.id) == home
        previous = nxt
    # the same chain asked of its replica directly gives the same text
    direct = oai(home[0]).responses.create(model=model, input="Go on (0).",
                                           previous_response_id=first.id, max_output_tokens=6,
                                           **GREEDY)
    again = client.responses.create(model=model, input="Go on (0).",
                                    previous_response_id=first.id, max_output_tokens=6, **GREEDY)
    assert again.output_text == direct.output_text
    # streamed: the router reads the id from the stream's events
    events = list(client.responses.create(model=model, input="Once more.", max_output_tokens=6,
                                          previous_response_id=previous.id, stream=True,
                                          **GREEDY))
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    follow = client.responses.create(model=model, input="And?", max_output_tokens=4,
                                     previous_response_id=streamed.id, **GREEDY)
    assert holders(cluster, streamed.id) == holders(cluster, follow.id) == home
    # GET, input_items and DELETE go to it too
    assert client.responses.retrieve(streamed.id).id == streamed.id
    assert client.responses.input_items.list(streamed.id).data
    client.responses.delete(streamed.id)
    assert holders(cluster, streamed.id) == []
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="x", previous_response_id=streamed.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_a_response_the_router_never_saw_is_found_on_its_replica(cluster, model):
    """Made on a replica directly (as before a restart of the router, or evicted from its
    memory): the router asks the replicas which holds it."""
    router, a, b, _ = cluster
    for srv in (a, b):
        made = oai(srv.url).responses.create(model=model, input="Hi.", max_output_tokens=4,
                                             **GREEDY)
        for _ in range(2):
            nxt = oai(router.url).responses.create(model=model, input="More.",
                                                   previous_response_id=made.id,
                                                   max_output_tokens=4, **GREEDY)
            assert holders(cluster, nxt.id) == [srv.url]
    bad = httpx.post(router.url + "/v1/responses", json={"input": "x", "previous_response_id": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "previous_response_id"


def merged_embedding(model_path: str, adapter: str | None, ids: list[int]) -> np.ndarray:
    """Hugging Face's reference: the last token's final hidden state, normalized, of the model
    with the PEFT adapter merged in (None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.inference_mode():
        last = model.eval().model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0).numpy()


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=GUARD_S, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, **GREEDY})


def test_lora_load_and_unload_fan_out_to_every_replica(cluster, model):
    router, a, b, root = cluster
    path = str(root / "sql")
    base = _complete(router.url, model).json()["choices"][0]["text"]
    loaded = httpx.post(router.url + "/v1/load_lora_adapter",
                        json={"lora_name": "sql", "lora_path": path}, timeout=GUARD_S)
    assert loaded.status_code == 200, loaded.text
    for srv in (a, b):
        assert "sql" in {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    direct = _complete(a.url, "sql").json()["choices"][0]["text"]
    assert direct != base  # the adapter changes the answer
    before = router.routed()
    texts = [_complete(router.url, "sql") for _ in range(2)]
    assert all(r.status_code == 200 for r in texts)
    assert [r.json()["choices"][0]["text"] for r in texts] == [direct, direct]
    sent = {u: n - before.get(u, 0) for u, n in router.routed().items()}
    assert sent == {a.url: 1, b.url: 1}  # one on each replica
    # embeddings under the adapter, on either replica: the merged model's last hidden state
    text = "Embed this under the adapter."
    ids = httpx.post(a.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    ref = merged_embedding(router.model_path, path, ids)
    base_ref = merged_embedding(router.model_path, None, ids)
    assert np.abs(ref - base_ref).max() > 1e-2
    for _ in range(2):
        emb = oai(router.url).embeddings.create(model="sql", input=text)
        assert emb.model == "sql"
        assert np.abs(np.asarray(emb.data[0].embedding) - ref).max() < 1e-4
    unloaded = httpx.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"},
                          timeout=GUARD_S)
    assert unloaded.status_code == 200, unloaded.text
    for srv in (a, b):
        assert "sql" not in {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}


def test_a_lora_load_refused_by_one_replica_names_it_and_is_undone_on_the_other(cluster):
    router, a, b, root = cluster
    path = str(root / "sql")
    # on a alone first: a refuses the router's load (already loaded), b's load is undone
    assert httpx.post(a.url + "/v1/load_lora_adapter",
                      json={"lora_name": "sql", "lora_path": path}).status_code == 200
    try:
        resp = httpx.post(router.url + "/v1/load_lora_adapter",
                          json={"lora_name": "sql", "lora_path": path}, timeout=GUARD_S)
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert "failed on 1 of 2 workers" in err["message"] and a.url in err["message"]
        assert b.url not in err["message"].split("unloaded again")[0], err["message"]
        assert err["param"] == "lora_name"
        assert "sql" not in {m["id"] for m in httpx.get(b.url + "/v1/models").json()["data"]}
    finally:
        httpx.post(a.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
    # unloading what nobody has: a 404 from both, said
    gone = httpx.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"},
                      timeout=GUARD_S)
    assert gone.status_code == 404 and "failed on 2 of 2 workers" in gone.json()["error"]["message"]
    bad = httpx.post(router.url + "/v1/load_lora_adapter", content=b"[1]", timeout=GUARD_S)
    assert bad.status_code == 400
