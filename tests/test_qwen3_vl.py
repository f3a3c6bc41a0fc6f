"""Qwen3-VL (a tiny random Qwen3VLForConditionalGeneration, fp32): greedy tokens through
LLM.generate with token ids and images equal HF transformers' for one image and two images of
different sizes (so different token counts) beside a text prompt; with chunked prefill and
preemptions; with a prefix-cache hit on a repeated image; and the M-RoPE positions of any
token range equal HF's get_rope_index."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from image_prompts import mm_prompt, random_image
from qwen3_vl_models import IMAGE_PAD, VISION_END, VISION_START, hf_greedy, hf_model, save_tiny_qwen3_vl

from kvflow.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, num_threads=1, quantization="none", num_blocks=64)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


A, B = random_image(40, 50, 0), random_image(20, 64, 1)  # 3 x 2 and 1 x 4 merged tokens
IMG = [VISION_START, IMAGE_PAD, VISION_END]
ONE = ([1, 40] + IMG + [50, 51, 52], [A])
TWO = ([1, 60] + IMG + [61] + IMG + [62, 63, 64], [B, A])
TEXT = ([1, 70, 71, 72, 73, 74], [])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_qwen3_vl(str(tmp_path_factory.mktemp("q3vl") / "m"))


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


def _reference(folder, hf, out, images, params=PARAMS) -> list[int]:
    return hf_greedy(folder, hf, list(out.prompt_token_ids), [i.image for i in images],
                     params.max_tokens)


def test_one_and_two_images_of_different_sizes_in_a_mixed_batch_equal_hf(folder, hf):
    from kvflow import LLM

    llm = LLM(folder, **ENGINE)
    try:
        outs = llm.generate([mm_prompt(p) for p in (ONE, TWO, TEXT)], PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [list(o.prompt_token_ids).count(IMAGE_PAD) for o in outs] == [6, 10, 0]
    for out, (_, images) in zip(outs, (ONE, TWO, TEXT)):
        assert list(out.outputs[0].token_ids) == _reference(folder, hf, out, images)


def test_chunked_prefill_and_preemption_equal_hf(folder, hf):
    """8 tokens a step (an image's run waits for a step that takes it whole), 12 blocks of 4
    for three requests growing by 16 tokens: preempted ones recompute, positions and images."""
    from kvflow import LLM

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(folder, **{**ENGINE, "num_blocks": 12}, max_num_batched_tokens=8, block_size=4,
              enable_prefix_caching=False)
    sched = llm.engine.core.scheduler
    seen, schedule = [], sched.schedule
    sched.schedule = lambda: seen.append(schedule()) or seen[-1]
    prompts = (ONE, TWO, TEXT)
    try:
        outs = llm.generate([mm_prompt(p) for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert sum(len(o.preempted_req_ids) for o in seen) > 0
    assert any(o.encoder_cuts for o in seen)
    for out, (_, images) in zip(outs, prompts):
        assert list(out.outputs[0].token_ids) == _reference(folder, hf, out, images, params)


def test_a_repeated_image_hits_the_prefix_cache(folder, hf):
    from kvflow import LLM

    llm = LLM(folder, **ENGINE, block_size=4)
    try:
        first = llm.generate(mm_prompt(TWO), PARAMS, use_tqdm=False)[0]
        again = llm.generate(mm_prompt(TWO), PARAMS, use_tqdm=False)[0]
        other = llm.generate(mm_prompt((TWO[0], [A, B])), PARAMS, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    ids = list(first.prompt_token_ids)
    assert again.num_cached_tokens > len(ids) - 4 - 1  # all but the last block
    assert other.num_cached_tokens <= ids.index(IMAGE_PAD) // 4 * 4
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(first.outputs[0].token_ids) == _reference(folder, hf, first, TWO[1])
    assert list(other.outputs[0].token_ids) == _reference(folder, hf, other, [A, B])


def test_mrope_positions_of_any_range_equal_hf_get_rope_index(folder, hf):
    from transformers import AutoTokenizer

    from kvflow.model.arch import load_arch_config
    from kvflow.models.qwen3_vl import mrope_positions
    from kvflow.multimodal.processor import multimodal_processor

    proc = multimodal_processor(folder, load_arch_config(folder), AutoTokenizer.from_pretrained(folder))
    ids, features = proc.apply(TWO[0], {"image": TWO[1]})
    t = torch.tensor([ids])
    grids = torch.tensor([[f.shape[0], f.shape[1], f.shape[2]] for f in features])
    ref, delta = hf.model.get_rope_index(t, (t == IMAGE_PAD).int(), image_grid_thw=grids)
    ref = ref[:, 0].numpy()
    n = len(ids)
    np.testing.assert_array_equal(mrope_positions(features, 0, n), ref)
    for start, end in ((3, 9), (7, n), (n - 2, n)):
        np.testing.assert_array_equal(mrope_positions(features, start, end), ref[:, start:end])
    # generated tokens: their index shifted as HF's rope delta says
    np.testing.assert_array_equal(mrope_positions(features, n, n + 3),
                                  np.arange(n, n + 3)[None].repeat(3, 0) + int(delta))


def test_the_served_engine_carries_the_image_grid_to_its_core_process(folder, hf):
    """AsyncLLM: the features (pixel values, their grid for M-RoPE) cross to the core process
    in its message; the tokens equal HF's."""
    import asyncio

    from kvflow.config import CacheConfig, EngineConfig, ModelConfig
    from kvflow.engine.async_engine import AsyncLLM

    async def main():
        engine = AsyncLLM(EngineConfig(ModelConfig(folder, dtype="float32", max_model_len=256),
                                       CacheConfig(num_blocks=64), warmup=False))
        await engine.start()
        try:
            tokens, prompt_ids = [], None
            async for out in engine.generate(TWO[0], PARAMS, "a", multi_modal_data={"image": TWO[1]}):
                tokens += out.outputs[0].token_ids
                prompt_ids = out.prompt_token_ids
            return tokens, prompt_ids
        finally:
            await engine.shutdown()

    tokens, prompt_ids = asyncio.run(main())
    assert tokens == hf_greedy(folder, hf, list(prompt_ids), [i.image for i in TWO[1]], 6)
