"""The encoder cache (vLLM's): an image's encoder output is kept by its content hash across
steps and requests, so two requests with the same image in one engine encode it once (the
prefix cache cannot help: their text differs before the image), and the answer from a cached
output is HF's; it holds `encoder_cache_size` image tokens, least recently used out first."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kvflow.multimodal.inputs import image_item
from kvflow.sampling_params import SamplingParams
from kvflow.worker.encoder_cache import EncoderCache
from vision_models import BOI, MM_TOKENS, hf_greedy, hf_model, save_tiny_gemma3_vision

ENGINE = dict(dtype="float32", max_model_len=256, num_threads=1, quantization="none",
              block_size=4)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _image(seed: int):
    rng = np.random.default_rng(seed)
    return image_item(Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)))


A, C = _image(0), _image(2)


def _prompt(first: int, image) -> dict:
    """Text that differs from the first token on, then the image, then more text."""
    return {"prompt_token_ids": [1, first, first + 1, BOI, 60, 61, 62],
            "multi_modal_data": {"image": [image]}}


def _count_encoded(llm) -> list[int]:
    """How many images each call of the model's encoder took, from now on."""
    model = llm.engine.core.executor.runner.model
    calls, embed = [], model.embed_multimodal

    def counted(pixels):
        calls.append(pixels.shape[0])
        return embed(pixels)

    model.embed_multimodal = counted
    return calls


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_gemma3_vision(str(tmp_path_factory.mktemp("g3v") / "m"))


@pytest.mark.slow
def test_two_requests_with_one_image_encode_it_once(folder):
    from kvflow import LLM

    llm = LLM(folder, **ENGINE)
    calls = _count_encoded(llm)
    try:
        first = llm.generate(_prompt(40, A), PARAMS, use_tqdm=False)[0]
        second = llm.generate(_prompt(90, A), PARAMS, use_tqdm=False)[0]
        assert sum(calls) == 1
        assert second.num_cached_tokens < list(second.prompt_token_ids).index(BOI)  # no prefix hit
        other = llm.generate(_prompt(90, C), PARAMS, use_tqdm=False)[0]
        assert sum(calls) == 2  # another image is encoded
    finally:
        llm.engine.shutdown()
    hf = hf_model(folder)
    for out, image in ((first, A), (second, A), (other, C)):
        assert list(out.outputs[0].token_ids) == hf_greedy(
            folder, hf, list(out.prompt_token_ids), [image.image], PARAMS.max_tokens)


@pytest.mark.slow
def test_the_cache_holds_encoder_cache_size_image_tokens(folder):
    from kvflow import LLM

    llm = LLM(folder, **ENGINE, encoder_cache_size=MM_TOKENS)  # one image
    calls = _count_encoded(llm)
    try:
        for first, image in ((40, A), (50, C), (60, A), (70, A)):
            llm.generate(_prompt(first, image), PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert sum(calls) == 3  # A, C (A out), A again (C out); then A is held


def test_least_recently_used_goes_first():
    cache = EncoderCache(capacity=5)
    a, b, c = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.full((3, 3), 3.0)
    cache.put("a", a)
    cache.put("b", b)
    a.zero_()  # a copy is kept, not the step's tensor
    assert torch.equal(cache.get("a"), torch.ones(2, 3))  # now b is the oldest
    cache.put("c", c)
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.num_tokens == 5
    cache.put("big", torch.zeros(6, 3))  # larger than the cache: not kept, nothing evicted
    assert cache.get("big") is None and cache.num_tokens == 5
    assert EncoderCache(0).get("a") is None
