"""A vision-language model served: the tiny random Gemma 3 (tests/vision_models.py) behind
`kvflow serve` answers an image through the OpenAI SDK (a data URL), the Responses API
(`input_image`) and the Anthropic SDK (a base64 block), each the same greedy tokens as the
offline `LLM.chat` on the same conversation; a different image changes the prompt's image
features (the prefix cache misses), the same image hits; a hostile image is still a 400
naming the part, and the server serves on."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import PIL.Image
import pytest

from kvflow import LLM, SamplingParams
from kvflow.chat_templates import GEMMA3
from server_helpers import ServerProcess, assert_server_clean
from vision_models import MM_TOKENS, save_tiny_gemma3_vision

pytestmark = pytest.mark.slow

TIMEOUT = 120
QUESTION = "What is this?"


def png(size, color) -> bytes:
    img = PIL.Image.new("RGB", size, color)
    img.putpixel((1, 1), (255 - color[0], 0, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = png((40, 24), (200, 20, 20)), png((17, 33), (10, 30, 220))


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("gemma3-vision"))
    save_tiny_gemma3_vision(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = GEMMA3  # Gemma 3's own template, image part included
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def offline(folder):
    llm = LLM(folder, dtype="float32", max_model_len=256, num_blocks=64, warmup=False)

    def answer(image: bytes) -> str:
        out = llm.chat([{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(image)}}]}],
            SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
        return out[0].outputs[0].text

    return answer


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess("--model", folder, "--dtype", "float32", "--max-model-len", "256",
                        "--num-blocks", "64", "--enable-prompt-tokens-details")
    yield srv
    srv.close()


def test_openai_responses_and_anthropic_get_the_offline_answer(server, offline):
    expected = offline(RED)
    assert expected
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    chat = oai.chat.completions.create(
        model=server_model(server), max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(RED)}}]}])
    assert chat.choices[0].message.content == expected
    # the prompt holds the image's tokens: more than the text alone
    text_only = oai.chat.completions.create(model=server_model(server), max_tokens=1,
                                            messages=[{"role": "user", "content": QUESTION}])
    assert chat.usage.prompt_tokens >= text_only.usage.prompt_tokens + MM_TOKENS + 2
    assert chat.choices[0].finish_reason == "length"  # six tokens, none of them the end

    resp = oai.responses.create(model=server_model(server), max_output_tokens=6, temperature=0,
                                input=[{"role": "user", "content": [
                                    {"type": "input_text", "text": QUESTION},
                                    {"type": "input_image", "image_url": data_url(RED)}]}])
    assert resp.output_text == expected

    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT)
    msg = claude.messages.create(model=server_model(server), max_tokens=6,
                                 extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
                                     {"type": "text", "text": QUESTION},
                                     {"type": "image", "source": {
                                         "type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}}]}])
    assert msg.content[0].text == expected
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert_server_clean(server)


def test_the_same_image_hits_the_prefix_cache_and_another_misses(server, offline):
    def cached(image: bytes) -> int:
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(BLUE)
    again = cached(BLUE)
    other = cached(png((17, 33), (10, 30, 221)))  # one channel of one colour apart
    assert again > other, (again, other)
    assert offline(BLUE)  # and the offline engine answers the other image too


def test_two_images_and_hostile_parts_on_a_vision_model(server):
    body = {"max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(RED)}},
        {"type": "image_url", "image_url": {"url": data_url(BLUE)}}]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for url, words in ((data_url(RED[:-30]), "corrupt"),
                       ("data:image/jpeg;base64," + base64.b64encode(RED).decode(), "not image/jpeg")):
        body["messages"][0]["content"][2]["image_url"]["url"] = url
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[2]"
        assert words in r.json()["error"]["message"]
        assert_server_clean(server)


def server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
