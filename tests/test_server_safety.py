"""Safety cases that belong to the engine: a model with several EOS ids stops on
each of them, survives `min_tokens` and runs to `max_tokens` with `ignore_eos` (offline with
`LLM`, and through a real `kvflow serve`); the server reports prefix-cache hits
(`usage.prompt_tokens_details`) only with --enable-prompt-tokens-details.

The model is a tiny random Llama-3-shaped HF folder with a byte-level tokenizer whose ids all
fit its vocabulary. Its greedy path is found first with `ignore_eos`; the EOS lists are then
chosen to contain the token that greedy decoding produces at a known step. Every server case
ends with `assert_server_clean`."""
from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3
from kvflow import LLM, SamplingParams
from server_helpers import ServerProcess, assert_server_clean

pytestmark = pytest.mark.slow  # loads a model and starts a server

PROMPT = [1, 40, 50, 60, 70]
MAX_TOKENS = 12
LLM_OPTIONS = dict(dtype="float32", max_model_len=128, num_blocks=64)


def with_eos(base: str, dest: str, config_eos: list[int], generation_eos: list[int]) -> str:
    """A copy of the folder `base` whose config.json and generation_config.json list these
    EOS ids (Llama 3.1 style: a list in each)."""
    shutil.copytree(base, dest)
    for name, eos in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        path = os.path.join(dest, name)
        with open(path) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dest


def first_occurrence(path: list[int], start: int) -> int:
    """The first step >= `start` whose token did not come up before it."""
    return next(k for k in range(start, len(path)) if path[k] not in path[:k])


class Greedy:
    """The tiny model's greedy path from PROMPT, two steps whose tokens are new there, and
    ids that greedy decoding never produces (padding for the EOS lists)."""

    def __init__(self, base: str) -> None:
        llm = LLM(base, **LLM_OPTIONS)
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)[0]
        self.path = list(out.outputs[0].token_ids)
        assert len(self.path) == MAX_TOKENS
        self.k1 = first_occurrence(self.path, 2)
        self.k2 = first_occurrence(self.path, self.k1 + 1)
        self.unused = [t for t in range(5, 260) if t not in self.path][:3]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_eos")
    base = str(root / "base")
    save_tiny_llama3(base)
    save_byte_tokenizer(base)
    greedy = Greedy(base)
    x, y, _ = greedy.unused
    # A: the id of step k1 is the second of config.json's list. B: the id of step k2 is only
    # in generation_config.json.
    a = with_eos(base, str(root / "a"), [x, greedy.path[greedy.k1]], [y])
    b = with_eos(base, str(root / "b"), [x, y], [y, greedy.path[greedy.k2]])
    return greedy, a, b


def test_llm_stops_on_an_eos_id_of_config_json_list(folders):
    greedy, a, _ = folders
    llm = LLM(a, **LLM_OPTIONS)
    assert greedy.path[greedy.k1] in llm.engine.core.arch.eos_token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == greedy.path[:greedy.k1 + 1]


def test_llm_stops_on_an_eos_id_only_in_generation_config(folders):
    greedy, _, b = folders
    llm = LLM(b, **LLM_OPTIONS)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == greedy.path[:greedy.k2 + 1]


def test_llm_min_tokens_with_a_list_of_eos_ids_neither_crashes_nor_stops_early(folders):
    greedy, a, _ = folders
    llm = LLM(a, **LLM_OPTIONS)
    eos = set(llm.engine.core.arch.eos_token_ids)
    assert len(eos) == 3
    min_tokens = greedy.k1 + 3
    # Two rows and a stop id beside the EOS list: the banned ids of the step are a flat list.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                            stop_token_ids=[greedy.unused[2]])
    outs = llm.generate([PROMPT, PROMPT[:3]], params, use_tqdm=False)
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) >= min_tokens
        assert not eos & set(tokens[:min_tokens]), "an EOS id came up before min_tokens"
    tokens = list(outs[0].outputs[0].token_ids)
    assert tokens[:greedy.k1] == greedy.path[:greedy.k1]  # the same path until the ban bites


def test_llm_ignore_eos_ignores_every_eos_id(folders):
    greedy, a, _ = folders
    llm = LLM(a, **LLM_OPTIONS)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and list(out.token_ids) == greedy.path


# -- through the server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(folders):
    _, a, _ = folders
    srv = ServerProcess("--model", a, "--dtype", "float32", "--max-model-len", "128",
                        "--num-blocks", "64", "--block-size", "4", "--max-waiting-requests", "16")
    yield srv
    srv.close()


def complete(srv: ServerProcess, **body) -> dict:
    resp = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_server_stops_on_an_eos_id_of_the_list(server, folders):
    greedy, _, _ = folders
    result = complete(server)
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == greedy.k1 + 1
    assert_server_clean(server)


def test_server_min_tokens_with_a_list_of_eos_ids_keeps_the_engine_alive(server, folders):
    greedy, _, _ = folders
    result = complete(server, min_tokens=greedy.k1 + 3, stop_token_ids=[greedy.unused[2]])
    assert result["usage"]["completion_tokens"] >= greedy.k1 + 3
    assert_server_clean(server)


def test_server_ignore_eos_runs_to_max_tokens(server):
    result = complete(server, ignore_eos=True)
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == MAX_TOKENS
    assert_server_clean(server)


# -- prefix-cache hits are a side channel: reported only when asked ----------------------------

def test_without_the_flag_usage_has_no_prompt_tokens_details(server):
    shared = list(range(5, 5 + 4 * 8))  # eight full blocks of 4, cached by the first request
    for _ in range(2):  # the second one hits the cache, and must not be told
        result = complete(server, prompt=shared + [9], max_tokens=2)
        assert "prompt_tokens_details" not in result["usage"]
        assert result["usage"]["prompt_tokens"] == len(shared) + 1
    body = {"prompt": shared + [9], "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    usages = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
    assert len(usages) == 1 and "prompt_tokens_details" not in usages[0]
    assert_server_clean(server)
