"""A quantized GGUF file cut for tensor and pipeline parallelism (kvflow/model/quant/gguf_shard.py):
each rank packs only its rows (q|k|v by heads, gate|up, the vocab) and its whole input blocks
(o_proj, down_proj), as stored: its panels hold exactly the weights one process packs for those
outputs and inputs; a cut that splits a stored block is refused with the numbers; and a GGUF
file is served as stored by default under tensor and pipeline parallelism."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest_model_helpers import _save_random, save_byte_tokenizer
from tiny_arch_models import write_gguf

from kvflow.model.arch import load_arch_config
from kvflow.model.quant.gguf_native import load_gguf_native
from kvflow.model.quant.gguf_shard import load_gguf_shard
from kvflow.model.quant.load import resolve_quantization
from kvflow.model.quant.packing import BLOCK, PANEL, RECORD_BYTES, dequantize_rows
from kvflow.model.sharding import shard_layout

# 8 heads of 64 / 2 KV heads: 4 ranks replicate each KV head; o_proj's and down_proj's inputs
# split 2 ways are 256 wide (a K-quant super-block), 4 ways 128 (not one)
SHAPE = dict(hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=321, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qshard") / "hf")
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _save_random(LlamaForCausalLM, config, path, seed=0)
    save_byte_tokenizer(path, SHAPE["vocab_size"])
    return path


@pytest.fixture(scope="module")
def gguf_files(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qshard-gguf")
    return lambda fmt: write_gguf(hf_dir, str(out / f"{fmt}.gguf"), quant=fmt) \
        if not (out / f"{fmt}.gguf").exists() else str(out / f"{fmt}.gguf")


def floats(w) -> torch.Tensor:
    """Every row of a packed weight, dequantised (the panels' zero padding dropped)."""
    return dequantize_rows(w.kind, w.packed, w.k, torch.arange(w.n), torch.float32)


def expected(whole: dict, name: str, arch, lay) -> torch.Tensor:
    """Rank `lay.rank`'s rows and columns of one process's weight `name`."""
    d = arch.head_dim
    q, kv, inter = arch.num_attention_heads * d, arch.num_key_value_heads * d, arch.intermediate_size
    q0, nq, k0, nk = lay.q_head_start * d, lay.num_heads * d, lay.kv_head_start * d, lay.num_kv_heads * d
    i0, ni = lay.inter_start, lay.intermediate_size
    w = floats(whole[name])
    kind = name.rsplit(".", 1)[-1]
    if kind == "qkv_proj":
        return torch.cat([w[q0:q0 + nq], w[q + k0:q + k0 + nk], w[q + kv + k0:q + kv + k0 + nk]])
    if kind == "o_proj":
        return w[:, q0:q0 + nq]
    if kind == "gate_up_proj":
        return torch.cat([w[i0:i0 + ni], w[inter + i0:inter + i0 + ni]])
    if kind == "down_proj":
        return w[:, i0:i0 + ni]
    out = torch.zeros(lay.vocab_per_rank, w.shape[1])  # embed_tokens, lm_head: padded vocab rows
    out[:lay.vocab_end - lay.vocab_start] = w[lay.vocab_start:lay.vocab_end]
    return out


@pytest.mark.parametrize("fmt,size", [("Q8_0", 2), ("Q4_0", 2), ("Q4_1", 2), ("Q4_K", 2),
                                      ("Q6_K", 2), ("Q8_0", 4), ("Q4_K_M", 2)])
def test_each_rank_packs_one_process_weights_for_its_rows_and_blocks(gguf_files, fmt, size):
    path = gguf_files(fmt)
    arch = load_arch_config(path)
    _, _, whole = load_gguf_native(path, torch.float32, "scalar")
    for rank in range(size):
        lay = shard_layout(arch, rank, size)
        plain, quant = load_gguf_shard(path, arch, torch.float32, "scalar", rank, size)
        assert set(quant) == set(whole)
        # the matrices are the packed blocks (uint8 records), never floats; only norms are floats
        assert all(t.dim() == 1 for t in plain.values())
        for name, w in quant.items():
            assert w.packed.dtype == torch.uint8 and w.kind == whole[name].kind
            if w.kind != "parts":  # Q4_K_M's qkv: its Q4_K q, k and Q6_K v each as stored
                assert w.nbytes == -(-w.n // PANEL) * (w.k // BLOCK) * RECORD_BYTES[w.kind]
            assert torch.equal(floats(w), expected(whole, name, arch, lay)), (fmt, rank, name)
        if fmt == "Q4_K_M":
            assert whole["layers.0.qkv_proj"].kind == "parts" and whole["layers.0.down_proj"].kind == "q6"
        # a rank holds its share: half (a quarter) of every projection, rows or input blocks
        assert quant["layers.0.down_proj"].k == arch.intermediate_size // size


def test_a_pipeline_stage_packs_only_its_layers(gguf_files):
    path = gguf_files("Q4_0")
    arch = load_arch_config(path)
    _, _, whole = load_gguf_native(path, torch.float32, "scalar")
    plain, quant = load_gguf_shard(path, arch, torch.float32, "scalar", 0, 1, layers=range(1, 2))
    assert sorted(quant) == ["layers.0.down_proj", "layers.0.gate_up_proj", "layers.0.o_proj",
                             "layers.0.qkv_proj", "lm_head"]  # no embedding: the first stage's
    assert "norm" in plain
    assert torch.equal(floats(quant["layers.0.qkv_proj"]), floats(whole["layers.1.qkv_proj"]))


def test_a_cut_inside_a_k_quant_super_block_is_refused_with_the_numbers(gguf_files):
    path = gguf_files("Q4_K")
    arch = load_arch_config(path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4: .*o_proj.* Q4_K in blocks of 256 "
                                         r"inputs, and each rank's 128 of its 512 inputs"):
        load_gguf_shard(path, arch, torch.float32, "scalar", 0, 4)


def test_a_gguf_file_is_served_as_stored_by_default_under_tp_and_pp(gguf_files, hf_dir):
    path = gguf_files("Q8_0")
    assert resolve_quantization(None, path, tp_size=2) == "gguf"
    assert resolve_quantization(None, path, tp_size=4) == "gguf"
    assert resolve_quantization("gguf", path, tp_size=2) == "gguf"
    assert resolve_quantization("none", path, tp_size=2) == "none"  # widened only on request
    with pytest.raises(ValueError, match="quantization int8 is not sharded across ranks"):
        resolve_quantization("int8", hf_dir, tp_size=2)
