"""Loading weights, architecture and tokenizer from HF folders and GGUF files."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest_model_helpers import save_tiny_llama3, save_tiny_qwen2
from kvflow.model.arch import LlamaArchConfig, load_arch_config
from kvflow.model.loader import load_model
from kvflow.model_path import cache_dir_for, default_model_path, resolve_model_path
from kvflow.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


def test_gguf_qk_permutation_is_undone_like_hf(gguf_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model, arch = load_model(gguf_path, torch.float32)
    reader = GGUFReader(gguf_path)
    raw = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors
           if t.name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight")}
    hf = LlamaTensorProcessor(config={"num_attention_heads": arch.num_attention_heads,
                                      "num_key_value_heads": arch.num_key_value_heads})
    q_size, kv_size = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    qkv = model.layers[3].qkv_proj
    for name, ours in (("blk.3.attn_q.weight", qkv[:q_size]), ("blk.3.attn_k.weight", qkv[q_size:q_size + kv_size])):
        expected = torch.from_numpy(hf.process(raw[name], name).weights.copy())
        assert torch.equal(ours, expected)
        assert not torch.equal(ours, torch.from_numpy(raw[name].copy())), "GGUF rows are stored permuted"


def test_second_load_comes_from_the_converted_cache_and_is_identical(gguf_path, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    first, arch = load_model(gguf_path, torch.bfloat16)
    first_tok = get_tokenizer(gguf_path)
    assert os.listdir(tmp_path), "the first load fills the cache"

    # the second load must not read the GGUF file again: neither its tensors nor its tokenizer
    import transformers

    from kvflow.checkpoint import gguf as gguf_reader

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    real_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def from_cache_only(*args, **kwargs):
        if "gguf_file" in kwargs:
            no_gguf()
        return real_from_pretrained(*args, **kwargs)

    monkeypatch.setattr(gguf_reader, "read_gguf", no_gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_cache_only)
    second, arch2 = load_model(gguf_path, torch.bfloat16)
    tok = get_tokenizer(gguf_path)
    assert arch2 == arch
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.embed_tokens.dtype == torch.bfloat16
    text = "The cache is keyed by path, size and mtime."
    assert tok.encode(text) == first_tok.encode(text)


def test_cache_key_changes_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    before = cache_dir_for(str(f))
    assert cache_dir_for(str(f)) == before
    f.write_bytes(b"x" * 11)
    assert cache_dir_for(str(f)) != before
    assert before.startswith(str(tmp_path / "cache"))


def test_resolve_model_path_errors_clearly_on_unknown_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(missing)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path))  # a folder with neither config.json nor .gguf


def test_resolve_model_path_accepts_default_folder_and_gguf(gguf_path, tmp_path):
    assert resolve_model_path(None) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path
    assert resolve_model_path(os.path.dirname(gguf_path)) == gguf_path  # folder with one .gguf
    hf_dir = save_tiny_qwen2(str(tmp_path / "qwen"))
    assert resolve_model_path(hf_dir) == hf_dir


def test_load_arch_config_reads_gguf_metadata(gguf_path):
    from gguf import GGUFReader

    arch = load_arch_config(gguf_path)
    reader = GGUFReader(gguf_path)

    def meta(key):
        return reader.fields[key].contents()

    assert arch.architecture == "LlamaForCausalLM"
    assert arch.num_hidden_layers == meta("llama.block_count")
    assert arch.hidden_size == meta("llama.embedding_length")
    assert arch.intermediate_size == meta("llama.feed_forward_length")
    assert arch.num_attention_heads == meta("llama.attention.head_count")
    assert arch.num_key_value_heads == meta("llama.attention.head_count_kv")
    assert arch.head_dim == arch.hidden_size // arch.num_attention_heads
    assert arch.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert arch.rope_theta == meta("llama.rope.freq_base")
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.rope_scaling is None
    assert arch.eos_token_ids == [meta("tokenizer.ggml.eos_token_id")]
    assert arch.kv_bytes_per_token(2) == arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2
    n_weights = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert arch.num_parameters() == n_weights


@pytest.mark.parametrize("make", [save_tiny_llama3, save_tiny_qwen2])
def test_load_arch_config_reads_hf_config(make, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make(str(tmp_path / "m"))
    arch = load_arch_config(path)
    cfg = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert arch.architecture == type(hf).__name__
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (
        cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert arch.rope_theta == cfg.rope_parameters["rope_theta"]
    assert arch.tie_word_embeddings == cfg.tie_word_embeddings
    assert arch.attention_bias == (hf.model.layers[0].self_attn.q_proj.bias is not None)
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    eos = cfg.eos_token_id
    assert arch.eos_token_ids == (eos if isinstance(eos, list) else [eos])
    if cfg.rope_parameters["rope_type"] == "llama3":
        assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_scaling["factor"] == 8.0


def test_transformers_4_rope_fields_and_unknown_rope_type(tmp_path):
    path = save_tiny_llama3(str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**params, "type": params.pop("rope_type")}  # transformers 4.x spelling
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    arch = load_arch_config(path)
    assert arch.rope_theta == cfg["rope_theta"] and arch.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="rope scaling type 'dynamic'"):
        LlamaArchConfig(**{**arch.to_dict(), "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="yarn rope scaling needs 'original_max_position_embeddings'"):
        LlamaArchConfig(**{**arch.to_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_hf_folder_with_sharded_safetensors_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_qwen2(str(tmp_path / "one"))
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a, _ = load_model(path, torch.float32)
    b, _ = load_model(sharded, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    shutil.rmtree(sharded)


def test_tokenizer_round_trips_cjk_and_emoji_and_has_chat_template(gguf_path):
    tok = get_tokenizer(gguf_path)
    text = "Hello, 世界! こんにちは 🌍🚀 naïve café"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_id == load_arch_config(gguf_path).eos_token_ids[0]
    assert tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi 你好"}], tokenize=False,
                                       add_generation_prompt=True)
    assert "hi 你好" in rendered and rendered.rstrip().endswith("assistant")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_engine_reads_the_model_config_once(fmt, tmp_path, monkeypatch):
    """The engine resolves the model's arch config once at start and hands it down: the loader,
    the quantized loader and the GGUF conversion never read config.json or the GGUF header again."""
    import importlib

    from kvflow import LLM
    from kvflow.model import arch as arch_module
    from tiny_arch_models import BUILDERS, write_gguf

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = BUILDERS["qwen3"](str(tmp_path / "hf"))
    path = folder if fmt == "hf" else write_gguf(folder, str(tmp_path / "m.gguf"))
    reads = []
    real = arch_module.load_arch_config
    monkeypatch.setattr(arch_module, "load_arch_config", lambda p: reads.append(p) or real(p))
    for module in ("kvflow.engine.core", "kvflow.model.loader", "kvflow.model.quant.load",
                   "kvflow.model.quant.int8"):
        if hasattr(importlib.import_module(module), "load_arch_config"):
            monkeypatch.setattr(f"{module}.load_arch_config", arch_module.load_arch_config)
    llm = LLM(path, tokenizer=folder, dtype="float32", max_model_len=64, num_blocks=16)
    assert reads == [path]
    assert llm.engine.core.arch.architecture == "Qwen3ForCausalLM"


def test_gguf_with_yarn_scaling_is_refused_naming_the_hf_folder(tmp_path, monkeypatch):
    """llama.cpp's YaRN keys are not read yet: such a file fails at load, pointing at the HF
    folder (whose YaRN is transformers')."""
    import gguf

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "yarn.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_vocab_size(320)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="YaRN rope scaling are not supported yet; use the Hugging Face folder"):
        load_arch_config(path)
