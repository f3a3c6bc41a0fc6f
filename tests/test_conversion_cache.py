"""The GGUF conversion cache (weights and tokenizer): a torn or truncated file is converted
again instead of trusted, and starts that race convert once. GGUF reading is replaced by a tiny
random model, so this runs in seconds."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from conftest_model_helpers import save_tiny_llama3
from kvflow.checkpoint import conversion_cache as weights_mod
from kvflow.checkpoint.conversion_cache import (cache_file_is_complete, ensure_gguf_cache,
                                                gguf_cache_file, load_gguf)
from kvflow.checkpoint.hf_folder import read_hf_folder
from kvflow.model.arch import load_arch_config

pytestmark = pytest.mark.slow  # builds a tiny transformers model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path whose 'conversion' reads a tiny HF folder; `calls` counts conversions."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_llama3(str(tmp_path / "tiny"))
    arch = load_arch_config(folder)
    arrays = {k: v.numpy() for k, v in read_hf_folder(folder, torch.float32).items()}
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    calls = []

    def read_gguf(p, convert=lambda a: a):
        calls.append(p)
        time.sleep(0.3)  # long enough for racing starts to overlap
        return arch, {k: convert(a) for k, a in arrays.items()}

    monkeypatch.setattr(weights_mod, "read_gguf", read_gguf)
    return str(path), calls


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 1e9])  # cut in the data, at the end, in the header
def test_a_truncated_weight_cache_is_converted_again(fake_gguf, keep):
    path, calls = fake_gguf
    first = load_gguf(path, torch.float32)
    cached = gguf_cache_file(path, torch.float32)
    assert cache_file_is_complete(cached) and len(calls) == 1
    size = os.path.getsize(cached)
    with open(cached, "r+b") as f:
        f.truncate(max(1, int(size * keep)))
    assert not cache_file_is_complete(cached)
    again = load_gguf(path, torch.float32)
    assert len(calls) == 2 and cache_file_is_complete(cached)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    load_gguf(path, torch.float32)
    assert len(calls) == 2  # complete now: read from the cache
    assert not [n for n in os.listdir(os.path.dirname(cached)) if n.endswith(".tmp")]


def test_starts_that_race_convert_once(fake_gguf):
    path, calls = fake_gguf
    results, errors = [], []

    def start():
        try:
            results.append(ensure_gguf_cache(path, torch.float32))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(calls) == 1
    assert cache_file_is_complete(results[0])


def test_a_broken_cached_tokenizer_is_converted_again(tmp_path, monkeypatch):
    import transformers
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from kvflow.model_path import cache_dir_for
    from kvflow.tokenizer import get_tokenizer

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    conversions = []
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(name)
            vocab = {"<unk>": 0, "hello": 1, "world": 2}
            return PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                unk_token="<unk>")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert get_tokenizer(str(path)).convert_tokens_to_ids("world") == 2
    cached = os.path.join(cache_dir_for(str(path)), "tokenizer", "tokenizer.json")
    assert len(conversions) == 1 and os.path.isfile(cached)
    get_tokenizer(str(path))
    assert len(conversions) == 1  # from the cache
    with open(cached, "r+b") as f:
        f.truncate(os.path.getsize(cached) // 2)
    assert get_tokenizer(str(path)).convert_tokens_to_ids("world") == 2
    assert len(conversions) == 2
    get_tokenizer(str(path))
    assert len(conversions) == 2


def test_a_torn_arch_cache_is_parsed_again(tmp_path, monkeypatch):
    """arch.json is written with fsync and an atomic rename; one that is torn anyway (a crash
    before this change, a full disk) is parsed from the file again, not trusted."""
    from kvflow.model import arch as arch_mod
    from kvflow.model_path import cache_dir_for

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_llama3(str(tmp_path / "tiny"))
    want = load_arch_config(folder)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    parsed = []

    class FakeReader:
        def __init__(self, p):
            parsed.append(p)

    import gguf
    monkeypatch.setattr(gguf, "GGUFReader", FakeReader)
    monkeypatch.setattr(arch_mod, "arch_from_gguf_reader", lambda reader, p: want)
    os.makedirs(cache_dir_for(str(path)), exist_ok=True)
    cached = os.path.join(cache_dir_for(str(path)), arch_mod.ARCH_CACHE_FILE)
    with open(cached, "w") as f:
        f.write('{"architecture": "LlamaFor')  # torn
    assert load_arch_config(str(path)) == want and len(parsed) == 1
    assert load_arch_config(str(path)) == want and len(parsed) == 1, "the rewritten cache serves"
