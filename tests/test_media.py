"""Reading images from requests (kvflow/multimodal/media.py): every source, every bound, and every
hostile input refused naming the part, before the work it would cost is done."""
from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import PIL.Image
import pytest

from kvflow.config import MultiModalConfig
from kvflow.multimodal.inputs import image_item
from kvflow.multimodal.media import MediaConnector
from kvflow.multimodal.parts import conversation_images
from kvflow.request import InvalidRequestError

WHERE = "messages[0].content[1]"


def encoded(fmt: str = "PNG", size=(5, 3), color=(10, 200, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    PIL.Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def refused(fn, *args, match: str = "") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args)
    assert e.value.param == WHERE and str(e.value).startswith(WHERE + ": ")
    assert match in str(e.value), str(e.value)
    return e.value


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a tiny body: decoding it would allocate
    the whole canvas."""
    buf = io.BytesIO()
    PIL.Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


# -- data URLs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_a_data_url_decodes_to_rgb_pixels_and_their_hash(fmt, mime):
    item = MediaConnector().load_url(data_url(encoded(fmt), mime), WHERE)
    assert item.image.mode == "RGB" and item.image.size == (5, 3)
    if fmt in ("PNG", "GIF", "WEBP"):  # lossless here: the pixels are the ones sent
        assert item.image.getpixel((2, 1)) in ((10, 200, 30), (8, 200, 32), (10, 200, 29))
    assert item.content_hash == image_item(item.image).content_hash


def test_the_content_hash_follows_the_pixels_not_the_encoding():
    a = MediaConnector().load_url(data_url(encoded("PNG")), WHERE)
    b = MediaConnector().load_url(data_url(encoded("GIF"), "image/gif"), WHERE)  # same pixels
    c = MediaConnector().load_url(data_url(encoded("PNG", color=(10, 200, 31))), WHERE)
    d = MediaConnector().load_url(data_url(encoded("PNG", size=(3, 5))), WHERE)
    assert a.content_hash == b.content_hash
    assert len({a.content_hash, c.content_hash, d.content_hash}) == 3


def test_a_cameras_jpeg_with_a_preview_is_a_jpeg():
    buf = io.BytesIO()
    frames = [PIL.Image.new("RGB", (6, 4), (0, 128, 255)), PIL.Image.new("RGB", (3, 2))]
    frames[0].save(buf, format="MPO", save_all=True, append_images=frames[1:])
    item = MediaConnector().load_url(data_url(buf.getvalue(), "image/jpeg"), WHERE)
    assert item.image.size == (6, 4)


def test_modes_other_than_rgb_are_converted():
    item = MediaConnector().load_url(data_url(encoded(mode="RGBA", color=(1, 2, 3, 4))), WHERE)
    assert item.image.mode == "RGB" and item.image.getpixel((0, 0)) == (1, 2, 3)


def test_a_wrong_media_type_is_refused():
    refused(MediaConnector().load_url, data_url(encoded(), "text/plain"), WHERE,
            match="'text/plain' is not an image")
    refused(MediaConnector().load_url, data_url(encoded("PNG"), "image/jpeg"), WHERE,
            match="the data is PNG, not image/jpeg")


def test_bytes_that_are_no_image_are_refused():
    refused(MediaConnector().load_url, data_url(b"<html>hello</html>"), WHERE, match="not an image")
    # a format Pillow reads but kvflow does not take
    buf = io.BytesIO()
    PIL.Image.new("RGB", (4, 4)).save(buf, format="BMP")
    refused(MediaConnector().load_base64, base64.b64encode(buf.getvalue()).decode(), None, WHERE,
            match="not an image")


def test_a_truncated_image_is_refused():
    raw = encoded("PNG", size=(64, 64), color=(1, 2, 3))
    refused(MediaConnector().load_url, data_url(raw[: len(raw) - 30]), WHERE, match="corrupt")
    buf = io.BytesIO()
    PIL.Image.effect_noise((128, 128), 64).convert("RGB").save(buf, format="JPEG")
    jpeg = buf.getvalue()  # the header is whole, the scan data cut
    refused(MediaConnector().load_url, data_url(jpeg[: len(jpeg) * 2 // 3], "image/jpeg"), WHERE,
            match="JPEG image is truncated or corrupt")


def test_bad_base64_and_malformed_data_urls_are_refused():
    refused(MediaConnector().load_url, "data:image/png;base64,@@@@", WHERE, match="not valid base64")
    refused(MediaConnector().load_url, "data:image/png;base64", WHERE, match="comma")
    raw = base64.b64encode(encoded()).decode()
    refused(MediaConnector().load_url, "data:image/png," + raw, WHERE, match="must be base64")


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch):
    raw = bomb_png(8000, 8000)  # 64M pixels in a few kilobytes
    assert len(raw) < 100_000
    loaded = []
    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load",
                        lambda self: loaded.append(self) or PIL.Image.Image.load(self))
    refused(MediaConnector(max_image_pixels=4096 * 4096).load_url, data_url(raw), WHERE,
            match="8000x8000")
    # past Pillow's own bound its open refuses it: still a refusal naming the part
    refused(MediaConnector().load_url, data_url(bomb_png(20000, 20000)), WHERE,
            match="over max_image_pixels")
    assert not loaded  # refused before any pixel was decoded


def test_the_pixel_limit_is_the_option():
    url = data_url(encoded(size=(40, 30)))
    assert MediaConnector(max_image_pixels=1200).load_url(url, WHERE).image.size == (40, 30)
    refused(MediaConnector(max_image_pixels=1199).load_url, url, WHERE, match="1200 pixels")


def test_huge_base64_is_refused_before_it_is_decoded(monkeypatch):
    conn = MediaConnector(max_image_bytes=1000)
    calls = []
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: calls.append(a))
    refused(conn.load_url, "data:image/png;base64," + "A" * 1400, WHERE, match="max_image_bytes")
    assert not calls
    monkeypatch.undo()
    # just under the limit in characters, still decoded and checked
    raw = encoded(size=(2, 2))
    assert MediaConnector(max_image_bytes=len(raw)).load_url(data_url(raw), WHERE)


def test_anthropic_base64_with_its_media_type():
    raw = base64.b64encode(encoded("JPEG")).decode()
    assert MediaConnector().load_base64(raw, "image/jpeg", WHERE).image.size == (5, 3)
    refused(MediaConnector().load_base64, raw, "image/png", WHERE, match="not image/png")
    refused(MediaConnector().load_base64, raw, "application/pdf", WHERE, match="not an image")


def test_other_schemes_are_refused():
    for url in ("ftp://example.com/a.png", "/etc/passwd", "gopher://x", "javascript:alert(1)", ""):
        refused(MediaConnector().load_url, url, WHERE)


# -- file:// ------------------------------------------------------------------------------------
def test_file_urls_only_under_the_allowed_folder(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(encoded(size=(7, 7)))
    (tmp_path / "secret.png").write_bytes(encoded())
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    refused(MediaConnector().load_url, f"file://{root}/cat.png", WHERE,
            match="without --allowed-local-media-path")
    conn = MediaConnector(allowed_local_media_path=str(root))
    assert conn.load_url(f"file://{root}/cat.png", WHERE).image.size == (7, 7)
    refused(conn.load_url, f"file://{tmp_path}/secret.png", WHERE, match="outside")
    refused(conn.load_url, f"file://{root}/../secret.png", WHERE, match="outside")
    refused(conn.load_url, f"file://{root}/link.png", WHERE, match="outside")  # symlink out
    refused(conn.load_url, f"file://{root}/missing.png", WHERE, match="no such file")
    refused(conn.load_url, f"file://{root}", WHERE, match="no such file")  # a folder
    refused(conn.load_url, f"file://evil.example{root}/cat.png", WHERE, match="no host")


def test_a_file_over_the_byte_limit_is_refused_unread(tmp_path):
    (tmp_path / "big.png").write_bytes(encoded(size=(300, 300)))
    conn = MediaConnector(allowed_local_media_path=str(tmp_path), max_image_bytes=100)
    refused(conn.load_url, f"file://{tmp_path}/big.png", WHERE, match="max_image_bytes")


# -- http(s) ------------------------------------------------------------------------------------
PNG = encoded(size=(9, 4))


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: bytes, ctype: str = "image/png", status: int = 200, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path == "/cat.png":
            self._send(PNG)
        elif self.path == "/gzip":
            self._send(PNG, headers=[("Content-Encoding", "gzip")])
        elif self.path == "/octet":
            self._send(PNG, "application/octet-stream")
        elif self.path == "/page":
            self._send(b"<html></html>", "text/html")
        elif self.path == "/missing":
            self._send(b"no", "text/plain", 404)
        elif self.path == "/redirect-in":
            self._send(b"", status=302, headers=[("Location", f"http://127.0.0.1:{port}/cat.png")])
        elif self.path == "/redirect-out":
            self._send(b"", status=302, headers=[("Location", f"http://localhost:{port}/cat.png")])
        elif self.path == "/loop":
            self._send(b"", status=302, headers=[("Location", "/loop")])
        elif self.path == "/huge":  # says so up front
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        elif self.path == "/endless":  # says nothing, then streams on
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(10_000):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        elif self.path == "/slow":  # a byte at a time, each within the per-read timeout
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for b in PNG:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_urls_are_refused_by_default(server):
    refused(MediaConnector().load_url, f"{server}/cat.png", WHERE, match="without --allowed-media-domains")
    refused(MediaConnector(allowed_media_domains=("example.com",)).load_url, f"{server}/cat.png",
            WHERE, match="'127.0.0.1' is not in --allowed-media-domains")


def test_an_allowed_domain_is_fetched(server):
    conn = MediaConnector(allowed_media_domains=("127.0.0.1",))
    assert conn.load_url(f"{server}/cat.png", WHERE).image.size == (9, 4)
    assert conn.load_url(f"{server}/octet", WHERE).image.size == (9, 4)
    assert conn.load_url(f"{server}/redirect-in", WHERE).image.size == (9, 4)


def test_fetch_refusals_name_the_part(server):
    conn = MediaConnector(allowed_media_domains=("127.0.0.1",))
    refused(conn.load_url, f"{server}/page", WHERE, match="'text/html' is not an image")
    refused(conn.load_url, f"{server}/missing", WHERE, match="HTTP 404")
    refused(conn.load_url, f"{server}/gzip", WHERE, match="compressed")
    refused(conn.load_url, f"{server}/redirect-out", WHERE, match="'localhost' is not in")
    refused(conn.load_url, f"{server}/loop", WHERE, match="redirects")
    refused(conn.load_url, "http://[::1/x.png", WHERE, match="not a valid URL")
    refused(MediaConnector(allowed_local_media_path="/tmp").load_url, "file://[x/a.png", WHERE,
            match="not a valid URL")
    refused(conn.load_url, f"{server}/huge", WHERE, match="1000000000 bytes")
    refused(MediaConnector(allowed_media_domains=("127.0.0.1",), max_image_bytes=2**20).load_url,
            f"{server}/endless", WHERE, match="over max_image_bytes")


def test_a_slow_download_is_cut_at_the_time_limit(server):
    conn = MediaConnector(allowed_media_domains=("127.0.0.1",), fetch_timeout=1.0)
    t0 = time.monotonic()
    refused(conn.load_url, f"{server}/slow", WHERE, match="took over 1.0 s")
    assert time.monotonic() - t0 < 3.0


def test_a_closed_port_is_a_refusal_not_a_crash():
    conn = MediaConnector(allowed_media_domains=("127.0.0.1",), fetch_timeout=1.0)
    refused(conn.load_url, "http://127.0.0.1:9/x.png", WHERE, match="fetching the image failed")


# -- options and parts --------------------------------------------------------------------------
def test_the_connector_follows_the_options(tmp_path):
    mm = MultiModalConfig(allowed_local_media_path=str(tmp_path),
                          allowed_media_domains=["Example.COM."], max_image_bytes="1KiB",
                          max_image_pixels=100, media_fetch_timeout=2)
    conn = MediaConnector.of(mm)
    assert conn == MediaConnector(str(tmp_path), ("example.com",), 1024, 100, 2)
    assert MultiModalConfig().limit("image") == 8
    assert MultiModalConfig(limit_mm_per_prompt='{"image": 2}').limit("image") == 2
    for bad in ('{"video": 1}', '{"image": -1}', '{"image": "2"}', "[1]"):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            MultiModalConfig(limit_mm_per_prompt=bad)


def test_parts_become_template_parts_and_image_refs_in_order():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": "data:a"}},
                    {"type": "text", "text": "with"},
                    {"type": "image_url", "image_url": {"url": "data:b", "detail": "auto"}}]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    convo, refs = conversation_images(messages)
    assert convo[0]["content"] == "be brief" and convo[2]["content"] == "ok"
    assert convo[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"},
                                   {"type": "text", "text": "with"}, {"type": "image"}]
    assert [(r.where, r.url) for r in refs] == [("messages[1].content[1]", "data:a"),
                                                ("messages[1].content[3]", "data:b")]


@pytest.mark.parametrize("part,match", [
    ({"type": "image_url", "image_url": {"url": "data:a", "detail": "high"}}, "detail"),
    ({"type": "image_url", "image_url": {}}, "needs its url"),
    ({"type": "input_audio", "input_audio": {}}, "'input_audio' is not supported"),
    ({"type": "text"}, "needs its text")])
def test_parts_that_cannot_be_read_are_refused_by_place(part, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        conversation_images([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.param == "messages[0].content[1]"
