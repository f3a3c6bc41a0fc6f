"""Gemma 3 under tensor and pipeline parallelism: greedy outputs (fp32) of a tiny random Gemma 3
(4 heads, 2 KV heads, 4 layers alternating a window of 8 with full attention, QK-norm, Gemma's
four norms, soft-capped logits, tied embeddings) equal one process's under TP=2, PP=2 and
TP=2 x PP=2 on kvflow's processes and PP=2 on Ray, with chunked prefill and preemption; and
the same for its Gemma3ForConditionalGeneration folder and its GGUF file under TP=2."""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest_model_helpers import save_byte_tokenizer
from window_model_helpers import generate_counting_preemptions, save_tiny_gemma3, save_tiny_gguf

from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", max_model_len=256, num_threads=1, quantization="none")
# 32 tokens a step: chunked prompts; 24 blocks of 16 cannot hold four requests growing to 108
# tokens in the full-attention layers' group beside the window group: some are preempted
SQUEEZED = dict(max_num_batched_tokens=32, num_blocks=24, block_size=16, max_num_seqs=8)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPTS = [[random.Random(n).randrange(4, 320) for _ in range(n)] for n in (60, 45, 30, 11)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    path = save_tiny_gemma3(str(tmp_path_factory.mktemp("g3") / "m"))
    save_byte_tokenizer(path)
    return path


def run(model: str, **kwargs) -> tuple[list[list[int]], int]:
    """Each prompt's tokens from a fresh engine, and how many preemptions it made."""
    return generate_counting_preemptions(model, PROMPTS, PARAMS, **{**ENGINE, **SQUEEZED, **kwargs})


@pytest.fixture(scope="module")
def reference(gemma3) -> list[list[int]]:
    out, preempted = run(gemma3)
    assert preempted, "the squeezed workload preempts nobody"
    assert len({tuple(o) for o in out}) == len(out)
    return out


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(tensor_parallel_size=2, pipeline_parallel_size=2)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_gemma3_equals_one_process(gemma3, reference, parallel):
    out, preempted = run(gemma3, **parallel)
    assert out == reference
    assert preempted


def test_gemma3_on_ray_pp2_equals_one_process(gemma3, reference):
    ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             logging_level="WARNING")
    try:
        out, _ = run(gemma3, pipeline_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert out == reference


def test_conditional_generation_folder_under_tp2_equals_one_process(gemma3, reference, tmp_path):
    """The text config nested, the language model's tensors under model.language_model., a
    vision tensor beside them: each rank reads its slices of the text part."""
    from safetensors.torch import load_file, save_file

    with open(f"{gemma3}/config.json") as f:
        text = json.load(f)
    folder = tmp_path / "vlm"
    folder.mkdir()
    with open(folder / "config.json", "w") as f:
        json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                   "text_config": {**text, "architectures": None}, "tie_word_embeddings": True,
                   "bos_token_id": 1, "eos_token_id": [2, 3]}, f)
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(f"{gemma3}/model.safetensors").items()}
    tensors["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_byte_tokenizer(str(folder))
    out, _ = run(str(folder), tensor_parallel_size=2)
    assert out == reference


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_gguf_under_tp2_equals_one_process(tmp_path, quant):
    """llama.cpp's gemma3 file (norms stored as 1 + w), float or Q8_0 with the default
    quantization option: Gemma 3 has no quantized kernels, so one process and each rank alike
    read the file's fp32 conversion cache (each rank its slices) and serve the same tokens."""
    hf = save_tiny_gemma3(str(tmp_path / "hf"), query_pre_attn_scalar=16)  # GGUF's key_length
    save_byte_tokenizer(hf)
    gguf = save_tiny_gguf(hf, str(tmp_path / "g3.gguf"), quant)
    options = dict(tokenizer=hf, quantization=None)
    one, _ = run(gguf, **options)
    out, _ = run(gguf, tensor_parallel_size=2, **options)
    assert out == one
