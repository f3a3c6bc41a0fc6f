"""An image prompt's length is the expanded one, everywhere the server measures it: the tiny
Gemma 3 vision model (tests/vision_models.py) behind `kvflow serve` with a small max_model_len
counts each image as its tokens in /tokenize and Anthropic's count_tokens (the count the
engine then runs), refuses a prompt that only its images push over max_model_len with a 400
naming the field before any stream starts (chat, Responses, Messages; streamed or not), and
takes vLLM's dotted `--limit-mm-per-prompt.image 2`."""
from __future__ import annotations

import base64
import io

import httpx
import PIL.Image
import pytest

from kvflow.chat_templates import GEMMA3
from server_helpers import ServerProcess, assert_server_clean
from vision_models import IMAGE, MM_TOKENS, save_tiny_gemma3_vision

pytestmark = pytest.mark.slow

TIMEOUT = 120
MAX_MODEL_LEN = 128


def png(color) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (20, 12), color).save(buf, format="PNG")
    return buf.getvalue()


RED = png((200, 20, 20))
URL = "data:image/png;base64," + base64.b64encode(RED).decode()


def chat_messages(text: str, images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}] +
             [{"type": "image_url", "image_url": {"url": URL}}] * images}]


def anthropic_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(RED).decode()}}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("gemma3-vision"))
    save_tiny_gemma3_vision(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = GEMMA3
    tok.save_pretrained(path)
    srv = ServerProcess("--model", path, "--dtype", "float32", "--max-model-len",
                        str(MAX_MODEL_LEN), "--num-blocks", "64",
                        "--limit-mm-per-prompt.image", "2")
    yield srv
    srv.close()


def post(server, path: str, body: dict) -> httpx.Response:
    if "model" in body:  # the Messages API's required model: the served one
        body = {**body, "model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]}
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


def tokenize(server, text: str, images: int = 1) -> list[int]:
    r = post(server, "/tokenize", {"messages": chat_messages(text, images)})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["tokens"])
    return r.json()["tokens"]


def test_tokenize_and_count_tokens_count_each_image_expanded(server):
    one, two = tokenize(server, "What is this?"), tokenize(server, "What is this?", images=2)
    assert one.count(IMAGE) == MM_TOKENS and two.count(IMAGE) == 2 * MM_TOKENS
    text_only = post(server, "/tokenize", {"messages": [{"role": "user", "content": "What is this?"}]})
    assert len(one) > len(text_only.json()["tokens"]) + MM_TOKENS
    # the count is the prompt the engine runs
    r = post(server, "/v1/chat/completions", {"max_tokens": 1, "messages": chat_messages("What is this?")})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(one)
    counted = post(server, "/v1/messages/count_tokens",
                   {"model": "m", "messages": anthropic_messages("What is this?")})
    assert counted.status_code == 200, counted.text
    msg = post(server, "/v1/messages", {"model": "m", "max_tokens": 1,
                                        "messages": anthropic_messages("What is this?")})
    assert msg.status_code == 200, msg.text
    assert counted.json()["input_tokens"] == msg.json()["usage"]["input_tokens"] > MM_TOKENS
    assert_server_clean(server)


def test_a_prompt_its_image_pushes_over_max_model_len_is_a_400_before_any_stream(server):
    base = len(tokenize(server, "What"))
    text = "What" + "a" * (MAX_MODEL_LEN - base)  # one byte, one token
    ids = tokenize(server, text)
    assert len(ids) == MAX_MODEL_LEN  # its text alone fits, with room to spare
    assert len(ids) - MM_TOKENS < MAX_MODEL_LEN
    for stream in (False, True):
        r = post(server, "/v1/chat/completions", {"messages": chat_messages(text), "stream": stream})
        assert r.status_code == 400, (stream, r.text)
        err = r.json()["error"]
        assert err["param"] == "prompt" and f"max_model_len is {MAX_MODEL_LEN}" in err["message"]
        r = post(server, "/v1/responses", {"max_output_tokens": 4, "stream": stream, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": text},
                                         {"type": "input_image", "image_url": URL}]}]})
        assert r.status_code == 400, (stream, r.text)
        assert "max_model_len" in r.json()["error"]["message"]
        r = post(server, "/v1/messages", {"model": "m", "max_tokens": 4, "stream": stream,
                                          "messages": anthropic_messages(text)})
        assert r.status_code == 400, (stream, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "max_model_len" in r.json()["error"]["message"]
    # one token shorter, and max_tokens what is left: it runs
    r = post(server, "/v1/chat/completions", {"messages": chat_messages(text[:-1]), "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    assert_server_clean(server)


def test_the_dotted_limit_mm_per_prompt_flag(server):
    r = post(server, "/v1/chat/completions", {"max_tokens": 1, "messages": chat_messages("Two", 2)})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {"max_tokens": 1, "messages": chat_messages("Three", 3)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[3]", r.text
    assert_server_clean(server)

