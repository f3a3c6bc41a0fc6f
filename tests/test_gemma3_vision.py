"""Gemma 3 with its vision tower (a tiny random Gemma3ForConditionalGeneration, fp32): greedy
tokens through LLM.generate with token ids and images equal HF transformers' for one image and
for two images of different sizes in a mixed batch; with chunked prefill whose chunks stop
before image runs (never inside one) and preemptions; the prefix cache hits on a repeated image
and misses on a different image behind the same token ids; and the bidirectional attention
over an image's run is what makes them equal."""
from __future__ import annotations

import numpy as np
import pytest

from image_prompts import mm_prompt, random_image
from vision_models import BOI, IMAGE, MM_TOKENS, hf_greedy, hf_model, save_tiny_gemma3_vision

from kvflow.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, num_threads=1, quantization="none")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


A, B, C = random_image(40, 50, 0), random_image(20, 64, 1), random_image(33, 33, 2)
ONE = ([1, 40, 41, BOI, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60], [A])
TWO = ([1, 70, BOI, 71, 72, 73, BOI, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83], [B, A])
TEXT = ([1] + list(range(100, 121)), [])
TWICE = ([1, BOI, 90, 91, BOI, 92, 93, 94], [C, C])  # one image twice: encoded once a step


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_gemma3_vision(str(tmp_path_factory.mktemp("g3v") / "m"))


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


def _reference(folder, hf, out, images, params=PARAMS) -> list[int]:
    return hf_greedy(folder, hf, list(out.prompt_token_ids), [i.image for i in images],
                     params.max_tokens)


def _watch(llm) -> list:
    """Every SchedulerOutput the engine's scheduler makes from now on."""
    sched = llm.engine.core.scheduler
    seen, schedule = [], sched.schedule

    def watched():
        seen.append(schedule())
        return seen[-1]

    sched.schedule = watched
    return seen


def test_one_and_two_images_in_a_mixed_batch_equal_hf(folder, hf):
    """One image; two of different sizes; none; the same image twice: one batch, HF's tokens."""
    from kvflow import LLM

    llm = LLM(folder, **ENGINE)
    try:
        outs = llm.generate([mm_prompt(p) for p in (ONE, TWO, TEXT, TWICE)], PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for out, (ids, images) in zip(outs, (ONE, TWO, TEXT, TWICE)):
        expanded = list(out.prompt_token_ids)
        assert expanded.count(IMAGE) == MM_TOKENS * len(images)
        assert list(out.outputs[0].token_ids) == _reference(folder, hf, out, images)


def test_chunked_prefill_stops_before_image_runs_and_preemption_stay_exact(folder, hf):
    """9 tokens a step: a chunk that would end inside an image's run stops before it, and
    the run is computed whole in the next step, with its encoder; 27 blocks of 4 cannot hold
    the three requests growing by 20 tokens at once: some are preempted and recomputed,
    images included."""
    from kvflow import LLM

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(folder, **ENGINE, max_num_batched_tokens=9, block_size=4, num_blocks=27,
              enable_prefix_caching=False)
    seen = _watch(llm)
    prompts = (ONE, TWO, TEXT)
    try:
        outs = llm.generate([mm_prompt(p) for p in prompts], params, use_tqdm=False)
        features = {}
        for out in seen:
            for new in out.scheduled_new_reqs:
                features[new.req_id] = new.mm_features
    finally:
        llm.engine.shutdown()
    cuts = [why for out in seen for why in out.encoder_cuts.values()]
    assert "image_run" in cuts
    assert sum(len(out.preempted_req_ids) for out in seen) > 0
    encoded = 0
    for out in seen:
        for rid, n in out.num_scheduled_tokens.items():
            start = out.num_computed_tokens[rid]
            for i, f in enumerate(features.get(rid, ())):
                overlaps = start < f.end and start + n > f.offset
                assert not overlaps or start + n >= f.end, "a chunk ended inside an image run"
                assert overlaps == (i in out.scheduled_encoder_inputs.get(rid, ()))
                encoded += overlaps
    assert encoded > 3  # three images, recomputed after a preemption
    for out, (_, images) in zip(outs, prompts):
        assert list(out.outputs[0].token_ids) == _reference(folder, hf, out, images, params)


def test_prefix_cache_hits_a_repeated_image_and_misses_a_different_one(folder, hf):
    from kvflow import LLM

    llm = LLM(folder, **ENGINE, block_size=4)
    ids = ONE[0]
    try:
        first = llm.generate(mm_prompt((ids, [A])), PARAMS, use_tqdm=False)[0]
        again = llm.generate(mm_prompt((ids, [A])), PARAMS, use_tqdm=False)[0]
        other = llm.generate(mm_prompt((ids, [C])), PARAMS, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    expanded = list(first.prompt_token_ids)
    assert list(other.prompt_token_ids) == expanded  # the same token ids, another image
    run_start = expanded.index(IMAGE)
    run_end = run_start + MM_TOKENS
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= run_end  # the image's blocks hit
    assert other.num_cached_tokens <= run_start // 4 * 4  # no block holding the image does
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(first.outputs[0].token_ids) == _reference(folder, hf, first, [A])
    assert list(other.outputs[0].token_ids) == _reference(folder, hf, other, [C])


def test_the_image_run_attends_bidirectionally(folder, monkeypatch):
    """Without the bidirectional pass over the image runs (causal only), the prompt's last
    logits move: the equivalence above rests on it."""
    import kvflow.layers.attention as attention
    from kvflow import LLM

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
    llm = LLM(folder, **ENGINE)
    try:
        exact = llm.generate(mm_prompt(TWO), params, use_tqdm=False)[0].outputs[0].logprobs[0]
        monkeypatch.setattr(attention, "attend_runs", lambda out, *a, **k: out)
        llm.reset_prefix_cache()
        causal = llm.generate(mm_prompt(TWO), params, use_tqdm=False)[0].outputs[0].logprobs[0]
    finally:
        llm.engine.shutdown()
    top = max(exact, key=lambda t: exact[t].logprob)
    assert top in causal and abs(exact[top].logprob - causal[top].logprob) > 1e-4


def test_images_must_pair_with_image_start_tokens(folder):
    from kvflow import LLM
    from kvflow.request import InvalidRequestError

    llm = LLM(folder, **ENGINE)
    try:
        with pytest.raises(InvalidRequestError, match="multi_modal_data"):
            llm.generate(mm_prompt((ONE[0], [A, B])), PARAMS, use_tqdm=False)
        assert llm.engine.input_processor.limits.supports_images
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


def test_the_served_engine_takes_images_in_its_core_process(folder, hf):
    """AsyncLLM (the server's engine, its core in another process): the prompt is expanded and
    the pixel values made in the frontend, carried to the core in its message; the tokens
    equal HF's."""
    import asyncio

    from kvflow.config import CacheConfig, EngineConfig, ModelConfig
    from kvflow.engine.async_engine import AsyncLLM

    async def main():
        engine = AsyncLLM(EngineConfig(ModelConfig(folder, dtype="float32", max_model_len=256),
                                       CacheConfig(num_blocks=64), warmup=False))
        await engine.start()
        try:
            assert engine.input_processor.limits.supports_images
            tokens, prompt_ids = [], None
            async for out in engine.generate(TWO[0], PARAMS, "a",
                                             multi_modal_data={"image": TWO[1]}):
                tokens += out.outputs[0].token_ids
                prompt_ids = out.prompt_token_ids
            return tokens, prompt_ids
        finally:
            await engine.shutdown()

    tokens, prompt_ids = asyncio.run(main())
    assert tokens == hf_greedy(folder, hf, list(prompt_ids), [i.image for i in TWO[1]], 8)


def test_the_processor_expands_and_preprocesses_as_hf_gemma3_processor(folder):
    """Token ids with one image-start token per image -> the ids HF's Gemma3Processor makes of
    the text, each image's placeholder run where its token_type_ids mark the image, and each
    image's pixel values as its image processor makes them."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    from kvflow.model.arch import load_arch_config
    from kvflow.multimodal.processor import multimodal_processor

    tok = AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>"})
    hf_proc = Gemma3Processor(AutoImageProcessor.from_pretrained(folder), tok,
                              image_seq_length=MM_TOKENS)
    text = "Look: <start_of_image> and then <start_of_image> what differs?"
    images = [B, C]
    ref = hf_proc(text=text, images=[i.image for i in images], return_tensors="np")
    ours = multimodal_processor(folder, load_arch_config(folder), tok)
    ids, features = ours.apply(tok.encode(text), {"image": images})
    assert ids == ref["input_ids"][0].tolist()
    marked = np.flatnonzero(ref["token_type_ids"][0]).tolist()
    assert marked == [p for f in features for p in range(f.offset, f.end)]
    assert [f.identifier for f in features] == [B.content_hash, C.content_hash]
    for f, pixels in zip(features, ref["pixel_values"]):
        np.testing.assert_array_equal(np.frombuffer(f.data, dtype=np.float32).reshape(f.shape), pixels)


def test_a_prefix_hit_that_ends_inside_an_image_run_stays_exact(folder, hf):
    """Blocks of 8: the image's run [6, 10) spans two blocks. A second prompt that differs
    after the run hits the first block only, so it starts inside the run: the run's remaining
    tokens are computed with the image encoded again, attending to the cached ones."""
    from kvflow import LLM

    ids = ONE[0]
    changed = ids[:5] + [99] + ids[6:]  # a token after the image, inside the run's second block
    llm = LLM(folder, **ENGINE, block_size=8)
    seen = _watch(llm)
    try:
        llm.generate(mm_prompt((ids, [A])), PARAMS, use_tqdm=False)
        out = llm.generate(mm_prompt((changed, [A])), PARAMS, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    expanded = list(out.prompt_token_ids)
    run_start = expanded.index(IMAGE)
    assert run_start < out.num_cached_tokens < run_start + MM_TOKENS
    last = [o for o in seen if o.scheduled_encoder_inputs][-1]
    (rid, start), = last.num_computed_tokens.items()
    assert start == out.num_cached_tokens and last.scheduled_encoder_inputs == {rid: [0]}
    assert list(out.outputs[0].token_ids) == _reference(folder, hf, out, [A])


def test_the_core_checks_the_images_a_direct_caller_hands_it(folder):
    """An EngineCoreRequest not checked by a frontend: runs outside the prompt or overlapping,
    and pixel values that do not fill their shape, are refused naming multi_modal_data."""
    from kvflow import LLM
    from kvflow.engine.protocol import EngineCoreRequest
    from kvflow.request import InvalidRequestError, MultiModalFeatureSpec, PlaceholderRange

    llm = LLM(folder, **ENGINE)
    ids, features = llm.engine.process_images(ONE[0], {"image": [A]})
    f = features[0]
    bad = [[MultiModalFeatureSpec("image", "x", PlaceholderRange(len(ids) - 2, 4), f.data, f.shape)],
           [f, f],
           [MultiModalFeatureSpec("image", "x", f.mm_position, f.data[:-4], f.shape)]]
    try:
        for i, feats in enumerate(bad):
            with pytest.raises(InvalidRequestError, match="multi_modal_data"):
                llm.engine.core.add_request(EngineCoreRequest(f"bad{i}", ids, PARAMS, mm_features=feats))
        llm.engine.core.add_request(EngineCoreRequest("good", ids, PARAMS, mm_features=features))
        while llm.engine.core.has_unfinished_requests():
            llm.engine.core.step()
    finally:
        llm.engine.shutdown()


def test_the_vision_tower_under_tensor_parallelism_is_refused_by_name(folder):
    from kvflow import LLM

    with pytest.raises(ValueError, match="vision tower does not run tensor- or pipeline-parallel"):
        LLM(folder, **ENGINE, tensor_parallel_size=2)


def test_the_dashboard_steps_show_the_image_tokens_encoded(folder):
    """Each step's stats count the image tokens whose encoder ran in it; the dashboard's step
    record carries them beside the prefill and decode split."""
    from kvflow import LLM
    from kvflow.engine.snapshot import SnapshotSource

    llm = LLM(folder, **ENGINE)
    try:
        core = llm.engine.core
        source = SnapshotSource(core.scheduler, interval_s=0.0)
        step, encoded = core.step, []

        def recorded():
            out = step()
            encoded.append(out.scheduler_stats.num_encoder_tokens)
            source.after_step(out.scheduler_stats)
            return out

        core.step = recorded
        llm.generate([mm_prompt(TWO)], PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert sum(encoded) == 2 * MM_TOKENS and encoded[-1] == 0  # both images, then decodes
    steps = list(source.steps)
    assert sum(s.encoder for s in steps) == 2 * MM_TOKENS
    assert all(s.encoder <= s.prefill for s in steps)
