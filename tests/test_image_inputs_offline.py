"""Images through the offline `LLM` and down to the engine: `LLM.chat` image parts and
`LLM.generate` with `multi_modal_data` are read, checked and refused by name on a text-only model
(never dropped, not even by the engine); with a model that takes images (the capability stubbed
here), the images reach the engine (processed once, then `add_request`) in the prompt's order, and the chat server's
job hands them to `engine.generate`."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import io

import PIL.Image
import pytest

from kvflow import LLM, SamplingParams
from kvflow.chat_templates import GEMMA3
from kvflow.config import EngineConfig, MultiModalConfig
from kvflow.engine.input_processor import InputProcessor, RequestLimits
from kvflow.multimodal.inputs import ImageItem, image_item

pytestmark = pytest.mark.slow  # loads a model


def png_url(size=(8, 6), color=(200, 10, 10)) -> str:
    buf = io.BytesIO()
    PIL.Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Compare"}, *parts]}]


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(default_model_path, dtype="float32", max_model_len=256, num_blocks=64,
               limit_mm_per_prompt={"image": 2})


def test_an_image_part_on_a_text_model_is_refused_naming_it(llm):
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: the loaded model takes "
                                         "no images"):
        llm.chat(ask(image_url(png_url())), use_tqdm=False)
    img = PIL.Image.new("RGB", (4, 4))
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: the loaded model"):
        llm.chat(ask({"type": "image_pil", "image_pil": img}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[1\]\.multi_modal_data\.image\[0\]: the "
                                         "loaded model takes no images"):
        llm.generate(["hi", {"prompt": "What is this?", "multi_modal_data": {"image": img}}],
                     use_tqdm=False)
    # nothing was queued: the engine still serves text
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                   SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_hostile_parts_are_refused_before_the_capability(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\]: the data is PNG, not "
                                         "image/gif"):
        llm.chat(ask(image_url(png_url()), image_url(png_url().replace("png", "gif", 1))),
                 use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]\.content\[1\]: file:// image URLs "
                                         "are refused"):
        llm.chat([ask(), ask(image_url("file:///etc/passwd"))], use_tqdm=False)
    bad = image_url("data:image/png;base64,!!")  # over the limit before any is decoded
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[3\]: 3 images in one prompt; "
                                         "at most 2"):
        llm.chat(ask(bad, bad, bad), use_tqdm=False)
    with pytest.raises(ValueError, match="embeddings of images are not implemented"):
        llm.embed({"prompt": "x", "multi_modal_data": {"image": PIL.Image.new("RGB", (2, 2))}})
    with pytest.raises(ValueError, match="'video'"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": []}}, use_tqdm=False)


@pytest.fixture
def vision_llm(llm, monkeypatch):
    """`llm` as if its model took images, with Gemma 3's template, and what it hands the
    engine's add_request recorded instead of run."""
    ip = llm.engine.input_processor
    monkeypatch.setattr(ip, "limits", dataclasses.replace(ip.limits, supports_images=True))
    monkeypatch.setattr(llm.tokenizer, "chat_template", GEMMA3)
    seen = []

    def add_request(request_id, prompt_token_ids, params, prompt=None, **kw):
        seen.append((prompt, prompt_token_ids, kw["mm_features"]))
        raise RuntimeError("recorded")

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    # the images, processed once before add_request, stand for their features here
    monkeypatch.setattr(llm.engine, "process_images", lambda ids, mm: (ids, mm))
    return llm, seen


def test_chat_images_reach_add_request_in_order(vision_llm):
    llm, seen = vision_llm
    small, big = PIL.Image.new("RGB", (3, 2), (1, 2, 3)), PIL.Image.new("RGB", (40, 30), (9, 9, 9))
    with pytest.raises(RuntimeError, match="recorded"):
        llm.chat([{"role": "user", "content": [
            {"type": "text", "text": "Look"}, image_url(png_url((40, 30), (9, 9, 9))),
            {"type": "text", "text": "then"}, {"type": "image_pil", "image_pil": small}]}],
            use_tqdm=False)
    prompt, ids, mm = seen[0]
    assert prompt == (llm.tokenizer.bos_token + "<start_of_turn>user\nLook<start_of_image>then"
                      "<start_of_image><end_of_turn>\n<start_of_turn>model\n")
    assert ids == llm.tokenizer.encode(prompt, add_special_tokens=False)
    assert [type(i) for i in mm["image"]] == [ImageItem, ImageItem]
    assert [i.image.size for i in mm["image"]] == [(40, 30), (3, 2)]
    assert [i.content_hash for i in mm["image"]] == [image_item(big).content_hash,
                                                     image_item(small).content_hash]


def test_generate_multi_modal_data_reaches_add_request(vision_llm):
    llm, seen = vision_llm
    a, b = PIL.Image.new("RGB", (5, 5), (0, 0, 0)), PIL.Image.new("L", (2, 7), 128)
    with pytest.raises(RuntimeError, match="recorded"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": [a, b]}},
                     use_tqdm=False)
    prompt, ids, mm = seen[0]
    assert prompt is None and ids == [1, 2, 3]
    assert [i.image.size for i in mm["image"]] == [(5, 5), (2, 7)]
    assert mm["image"][1].image.mode == "RGB"  # converted
    big = PIL.Image.new("RGB", (4097, 4096))
    with pytest.raises(ValueError, match=r"prompts\[0\]\.multi_modal_data\.image\[0\]: the "
                                         "image is 4097x4096"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": big}}, use_tqdm=False)


def test_the_engine_of_a_text_model_never_drops_images(llm):
    item = image_item(PIL.Image.new("RGB", (2, 2)))
    for checked in (False, True):  # even past the frontend's checks
        with pytest.raises(ValueError, match="multi_modal_data: this model does not take "
                                             "images") as e:
            llm.engine.add_request("img", [1, 2], SamplingParams(max_tokens=2), checked=checked,
                                   multi_modal_data={"image": [item]})
        assert e.value.param == "multi_modal_data"
    assert not llm.engine.has_unfinished_requests()


def test_the_input_processor_checks_images():
    limits = RequestLimits(100, 64, 16, 10)
    config = EngineConfig(multimodal_config=MultiModalConfig(limit_mm_per_prompt={"image": 1}))
    item = image_item(PIL.Image.new("RGB", (2, 2)))
    with pytest.raises(ValueError, match=r"^multi_modal_data\.image\[0\]: the loaded model takes "
                                         "no images") as e:
        InputProcessor(config, limits).process([1], SamplingParams(max_tokens=2),
                                               multi_modal_data={"image": [item]})
    assert e.value.param == "multi_modal_data.image[0]"
    vision = InputProcessor(config, dataclasses.replace(limits, supports_images=True))
    vision.process([1], SamplingParams(max_tokens=2), multi_modal_data={"image": [item]})
    with pytest.raises(ValueError, match=r"^p\[1\]: 2 images in one prompt; at most 1"):
        vision.process([1], SamplingParams(max_tokens=2), multi_modal_data={"image": [item] * 2},
                       image_names=["p[0]", "p[1]"])
    with pytest.raises(ValueError, match="expected an ImageItem"):
        vision.process([1], SamplingParams(max_tokens=2),
                       multi_modal_data={"image": [PIL.Image.new("RGB", (2, 2))]})
    ready = type("Ready", (), {"vocab_size": 1, "max_model_len": 2, "block_size": 2,
                               "num_blocks": 3, "supports_images": True})
    assert RequestLimits.of(ready).supports_images


def test_the_chat_server_hands_images_to_engine_generate(default_tokenizer, monkeypatch):
    """OpenAIServingChat.prepare -> engine.process_images (the prompt expanded before its
    checks) -> chunks -> engine.generate(expanded ids, mm_features=...), with an engine whose
    model takes images."""
    from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
    from kvflow.entrypoints.openai.server_settings import ServerSettings
    from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat

    calls, processed = [], []

    class Engine:
        config = EngineConfig()
        tokenizer = default_tokenizer
        max_model_len = 512
        is_dead = False
        input_processor = InputProcessor(config, RequestLimits(
            len(default_tokenizer), 512, 16, 100, supports_images=True))

        async def process_images(self, ids, mm):
            processed.append((list(ids), mm))
            return ids + [7] * 3 * len(mm["image"]), ["feature"] * len(mm["image"])

        async def generate(self, ids, params, request_id, **kw):
            calls.append((ids, kw))
            return
            yield

    monkeypatch.setattr(default_tokenizer, "chat_template", GEMMA3)
    chat = OpenAIServingChat(Engine(), ServerSettings())
    req = ChatCompletionRequest.model_validate({"max_tokens": 2, "messages": ask(
        image_url(png_url((6, 6))), image_url(png_url((9, 2))))})

    async def run():
        job = await chat.prepare(req)
        async for _ in chat.chunks(job):
            pass
        return job

    job = asyncio.run(run())
    rendered, mm = processed[0]
    assert [i.image.size for i in mm["image"]] == [(6, 6), (9, 2)]
    ids, kw = calls[0]
    assert ids == job.prompt_ids == rendered + [7] * 6 and job.prompt.count("<start_of_image>") == 2
    assert kw["mm_features"] == ["feature", "feature"] and kw["checked"]
