"""Images through one real `kvflow serve` of a text-only model: every hostile image part, on
every API that takes images (chat `image_url`, Responses `input_image`, Anthropic `image`
blocks), is a 400 naming the part, checked before the model's own refusal; a well-formed image
is refused as one the model cannot take (never dropped); and after each case the server is
clean and answers the next request."""
from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import PIL.Image
import pytest

from server_helpers import ServerProcess, assert_server_clean

pytestmark = pytest.mark.slow

TIMEOUT = 120
MODEL = "SmolLM2-135M-Instruct"


def png(size=(8, 6), color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def bomb() -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("1", (6000, 6000)).save(buf, format="PNG")
    return buf.getvalue()


class _Images(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body, ctype = (png(), "image/png") if self.path == "/cat.png" else (b"<p>", "text/html")
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png())
    (root.parent / "outside.png").write_bytes(png())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(media):
    root, _ = media
    srv = ServerProcess("--max-model-len", "512", "--num-blocks", "128", "--max-num-seqs", "4",
                        "--max-waiting-requests", "4", "--limit-mm-per-prompt", '{"image": 2}',
                        "--allowed-local-media-path", str(root),
                        "--allowed-media-domains", "127.0.0.1",
                        "--max-image-pixels", str(2**20), "--max-image-bytes", "64KiB")
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def clean_after_each_case(server):
    yield
    assert_server_clean(server)


def chat_body(*parts) -> dict:
    return {"max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def refusal(server, path: str, body: dict) -> dict:
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    return err


def hostile_urls(media) -> list[tuple[str, str]]:
    """(image URL, words of its refusal), each hostile or out of bounds."""
    root, web = media
    raw = png(size=(64, 64))
    return [
        (data_url(raw[:-40]), "corrupt"),  # truncated
        (data_url(bomb()), "6000x6000"),  # a decompression bomb: 36M pixels in a few KiB
        (data_url(b"<html>hi</html>", "text/html"), "'text/html' is not an image"),
        (data_url(raw, "image/jpeg"), "is PNG, not image/jpeg"),
        ("data:image/png;base64," + "A" * 100_000, "max_image_bytes"),  # huge base64
        ("data:image/png;base64,!!!!", "not valid base64"),
        (f"file://{root.parent}/outside.png", "outside --allowed-local-media-path"),
        (f"file://{root}/../outside.png", "outside --allowed-local-media-path"),
        (f"{web.replace('127.0.0.1', 'localhost')}/cat.png", "not in --allowed-media-domains"),
        (f"{web}/page", "'text/html' is not an image"),
        ("ftp://127.0.0.1/cat.png", "not an image URL kvflow reads"),
    ]


def test_each_hostile_chat_image_is_a_400_naming_its_part(server, media):
    for url, words in hostile_urls(media):
        err = refusal(server, "/v1/chat/completions",
                      chat_body({"type": "text", "text": "and"}, image_part(url)))
        assert err["param"] == "messages[1].content[2]", (url[:80], err)
        assert err["message"].startswith("messages[1].content[2]: ") and words in err["message"], \
            (url[:80], err)


def test_too_many_images_are_refused_before_any_is_read(server):
    # the third image is over --limit-mm-per-prompt; the first two are not images at all, so a
    # refusal naming the count shows that nothing was read before it
    bad = image_part("data:image/png;base64,!!!!")
    err = refusal(server, "/v1/chat/completions", chat_body(bad, bad, bad))
    assert err["param"] == "messages[1].content[3]" and "at most 2" in err["message"], err


def test_unsupported_parts_and_detail_are_refused_by_name(server):
    err = refusal(server, "/v1/chat/completions",
                  chat_body(image_part(data_url(png()), detail="high")))
    assert err["param"] == "messages[1].content[1]" and "detail" in err["message"]
    err = refusal(server, "/v1/chat/completions",
                  chat_body({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}))
    assert err["param"] == "messages[1].content[1]" and "'input_audio'" in err["message"]
    # an in-process PIL part is the offline LLM's; from the network it is an unknown part
    err = refusal(server, "/v1/chat/completions", chat_body({"type": "image_pil", "image_pil": "x"}))
    assert err["param"] == "messages[1].content[1]"


def test_a_good_image_on_a_text_model_is_refused_never_dropped(server, media):
    root, web = media
    for url in (data_url(png()), f"file://{root}/cat.png", f"{web}/cat.png"):
        err = refusal(server, "/v1/chat/completions", chat_body(image_part(url)))
        assert err["param"] == "messages[1].content[1]", err
        assert "the loaded model takes no images" in err["message"], err
    # /tokenize does not count images: a refusal, not a count without them
    resp = httpx.post(f"{server.url}/tokenize", json={"messages": chat_body(
        image_part(data_url(png())))["messages"]}, timeout=TIMEOUT)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[1].content[1]"


def test_text_parts_alone_still_make_one_text(server):
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT, json={
        "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Name a "}, {"type": "text", "text": "fruit."}]}]})
    assert resp.status_code == 200, resp.text
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT, json={
        "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Name a fruit."}]})
    assert resp.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert resp.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_the_openai_sdk_reads_the_refusal(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": data_url(png())}}]}])
    assert e.value.body["param"] == "messages[0].content[1]"
    assert "takes no images" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": data_url(png(), "image/gif")}]}])
    assert e.value.body["param"] == "input[0].content[1]", e.value.body
    assert "is PNG, not image/gif" in e.value.body["message"]


def test_responses_input_images_are_named_by_their_item(server, media):
    for url, words in hostile_urls(media)[:6]:
        err = refusal(server, "/v1/responses", {
            "max_output_tokens": 2, "instructions": "Be brief.", "input": [
                {"role": "user", "content": "hello"},
                {"role": "user", "content": [{"type": "input_text", "text": "this?"},
                                             {"type": "input_image", "image_url": url}]}]})
        assert err["param"] == "input[1].content[1]" and words in err["message"], (url[:80], err)
    err = refusal(server, "/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(png())}]}]})
    assert err["param"] == "input[0].content[0]" and "takes no images" in err["message"]


def test_anthropic_image_blocks_are_named_by_their_block(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT)

    def image(raw: bytes, media_type: str = "image/png") -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                            "data": base64.b64encode(raw).decode()}}

    cases = [(image(png()[:-30]), "corrupt"), (image(bomb()), "6000x6000"),
             (image(png(), "image/jpeg"), "is PNG, not image/jpeg"),
             (image(b"%PDF-1.4", "application/pdf"), "'application/pdf' is not an image"),
             (image(png()), "the loaded model takes no images")]
    for block, words in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            # a text block, then a tool result, then the image: its chat message is not the
            # block's message, and the refusal still names the block
            claude.messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "done"},
                    {"type": "text", "text": "What is this?"}, block]}],
                tools=[{"name": "look", "input_schema": {"type": "object"}}],
                tool_choice={"type": "any"})
        message = e.value.body["error"]["message"]
        assert message.startswith("messages[2].content[2]: ") and words in message, message
    with pytest.raises(anthropic.BadRequestError, match="an image block belongs in a user"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [image(png())]}, {"role": "user", "content": "ok"}])
