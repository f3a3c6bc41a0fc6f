"""Reading an image a request names: a `data:` URL, a `file://` URL under the allowed folder, an
`http(s)://` URL from an allowed domain, or base64 with its media type (Anthropic's source).

Everything here comes from the network and is hostile until checked, so each source is bounded
before any work is spent on it: a data URL's length before its base64 is decoded, a file's and
a download's bytes before they are read (a download's time in all, too), the media type before
the bytes are handed to Pillow, and the pixel count from the image's header before its pixels
are decoded (a decompression bomb is refused unread). Every refusal is an InvalidRequestError
whose message starts with, and whose `param` is, the part it came from
(`messages[0].content[1]`), so the server answers a 400 naming it."""
from __future__ import annotations

import base64
import binascii
import io
import math
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import PIL.Image

from kvflow.multimodal.inputs import ImageItem, image_item
from kvflow.request import InvalidRequestError

# the formats read (OpenAI's: PNG, JPEG, WEBP and non-animated GIF, whose first frame is used)
# -> their media type; Pillow is asked to try these decoders only
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MEDIA_TYPES = {mime: fmt for fmt, mime in IMAGE_FORMATS.items()} | {"image/jpg": "JPEG"}
MAX_REDIRECTS = 3


def refuse(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {why}", where)


@dataclass(frozen=True)
class MediaConnector:
    """Reads and bounds images by the engine's options (MultiModalConfig): `load_url` for an
    image URL, `load_base64` for base64 and its media type, `decode` for bytes in hand."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    fetch_timeout: float = 5.0

    @classmethod
    def of(cls, mm_config) -> "MediaConnector":
        """The connector a MultiModalConfig describes."""
        return cls(mm_config.allowed_local_media_path, tuple(mm_config.allowed_media_domains),
                   mm_config.max_image_bytes, mm_config.max_image_pixels,
                   mm_config.media_fetch_timeout)

    # -- sources ------------------------------------------------------------------------------
    def load_url(self, url: str, where: str) -> ImageItem:
        """The image an `image_url` names; a refusal names `where`."""
        if not isinstance(url, str) or not url:
            raise refuse(where, "the image URL is empty")
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme == "data":
            return self.load_data_url(url, where)
        if scheme == "file":
            return self.load_file(url, where)
        if scheme in ("http", "https"):
            return self.fetch(url, where)
        raise refuse(where, f"{url[:32]!r} is not an image URL kvflow reads (data:, file:// under "
                            "--allowed-local-media-path, http(s):// from --allowed-media-domains)")

    def load_data_url(self, url: str, where: str) -> ImageItem:
        head, sep, payload = url[:256].partition(",")
        if not sep:
            raise refuse(where, "a data URL needs a comma before its data")
        params = head[len("data:"):].split(";")
        if "base64" not in (p.strip().lower() for p in params[1:]):
            raise refuse(where, "a data URL's image must be base64 (data:image/png;base64,...)")
        payload = url[len(head) + 1:]
        return self.load_base64(payload, params[0].strip().lower(), where)

    def load_base64(self, data: str, media_type: str | None, where: str) -> ImageItem:
        """Base64 `data` of an image of `media_type` (None: whatever image it is)."""
        if media_type is not None:
            self.format_of(media_type, where)  # a wrong media type is refused before decoding
        if not isinstance(data, str):
            raise refuse(where, "the image data must be a base64 string")
        limit = 4 * math.ceil(self.max_image_bytes / 3)
        if len(data) > limit:
            raise refuse(where, f"{len(data)} characters of base64 is over max_image_bytes "
                                f"({self.max_image_bytes} bytes, {limit} characters)")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise refuse(where, "the image data is not valid base64") from None
        return self.decode(raw, where, media_type)

    def load_file(self, url: str, where: str) -> ImageItem:
        if self.allowed_local_media_path is None:
            raise refuse(where, "file:// image URLs are refused (without "
                                "--allowed-local-media-path / allowed_local_media_path)")
        try:
            parsed = urllib.parse.urlparse(url)
        except ValueError:
            raise refuse(where, f"{url[:64]!r} is not a valid URL") from None
        if parsed.netloc not in ("", "localhost"):
            raise refuse(where, f"a file:// URL names no host, got {parsed.netloc[:64]!r}")
        root = Path(self.allowed_local_media_path).resolve()
        path = Path(urllib.parse.unquote(parsed.path)).resolve()  # symlinks followed, then checked
        if not path.is_relative_to(root):
            raise refuse(where, "the file is outside --allowed-local-media-path")
        if not path.is_file():
            raise refuse(where, "no such file under --allowed-local-media-path")
        if path.stat().st_size > self.max_image_bytes:
            raise refuse(where, f"the file has {path.stat().st_size} bytes; max_image_bytes is "
                                f"{self.max_image_bytes}")
        with open(path, "rb") as f:
            raw = f.read(self.max_image_bytes + 1)
        if len(raw) > self.max_image_bytes:
            raise refuse(where, f"the file is over max_image_bytes ({self.max_image_bytes})")
        return self.decode(raw, where, None)

    def fetch(self, url: str, where: str) -> ImageItem:
        """An http(s) image from an allowed domain: redirects followed only to allowed domains,
        at most max_image_bytes, in at most fetch_timeout seconds in all."""
        import httpx

        deadline = time.monotonic() + self.fetch_timeout
        # trust_env off: the operator's allow-list, not a proxy from the environment, decides
        with httpx.Client(timeout=self.fetch_timeout, follow_redirects=False,
                          trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self.check_domain(url, where)
                try:
                    # identity only: a compressed body could inflate past the byte limit at once
                    with client.stream("GET", url,
                                       headers={"Accept-Encoding": "identity"}) as resp:
                        if resp.is_redirect:
                            url = str(resp.url.join(resp.headers.get("location", "")))
                            continue
                        return self._read_response(resp, where, deadline)
                except (httpx.HTTPError, httpx.InvalidURL) as e:
                    raise refuse(where, f"fetching the image failed: {type(e).__name__}") from None
        raise refuse(where, f"more than {MAX_REDIRECTS} redirects")

    def check_domain(self, url: str, where: str) -> None:
        try:
            parsed = urllib.parse.urlparse(url)
            host = (parsed.hostname or "").lower().rstrip(".")
        except ValueError:  # e.g. an unclosed IPv6 bracket
            raise refuse(where, f"{url[:64]!r} is not a valid URL") from None
        if parsed.scheme not in ("http", "https") or not host:
            raise refuse(where, f"{url[:64]!r} is not an http(s) URL")
        if host not in self.allowed_media_domains:
            why = ("http(s) image URLs are refused (without --allowed-media-domains / "
                   "allowed_media_domains)" if not self.allowed_media_domains else
                   f"{host[:64]!r} is not in --allowed-media-domains")
            raise refuse(where, why)

    def _read_response(self, resp, where: str, deadline: float) -> ImageItem:
        if resp.status_code != 200:
            raise refuse(where, f"fetching the image answered HTTP {resp.status_code}")
        length = resp.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_image_bytes:
            raise refuse(where, f"the image has {length} bytes; max_image_bytes is "
                                f"{self.max_image_bytes}")
        ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        declared = None if ctype in ("", "application/octet-stream") else ctype
        if declared is not None:
            self.format_of(declared, where)
        if resp.headers.get("content-encoding", "identity").lower() != "identity":
            raise refuse(where, "the image was sent compressed (Content-Encoding); kvflow asks "
                                "for it as is")
        chunks, size = [], 0
        for chunk in resp.iter_raw():  # as it arrives, so that the clock is checked often
            size += len(chunk)
            if size > self.max_image_bytes:
                raise refuse(where, f"the image is over max_image_bytes ({self.max_image_bytes})")
            if time.monotonic() > deadline:
                raise refuse(where, f"fetching the image took over {self.fetch_timeout} s")
            chunks.append(chunk)
        return self.decode(b"".join(chunks), where, declared)

    # -- bytes -> image -----------------------------------------------------------------------
    @staticmethod
    def format_of(media_type: str, where: str) -> str:
        fmt = MEDIA_TYPES.get(media_type.lower())
        if fmt is None:
            raise refuse(where, f"media type {media_type[:64]!r} is not an image kvflow reads "
                                f"({', '.join(IMAGE_FORMATS.values())})")
        return fmt

    def decode(self, raw: bytes, where: str, media_type: str | None = None) -> ImageItem:
        """Decode `raw` (of `media_type` if given, which must then be what the bytes are),
        refusing more than max_image_pixels from the header, before the pixels are decoded."""
        if len(raw) > self.max_image_bytes:
            raise refuse(where, f"the image has {len(raw)} bytes; max_image_bytes is "
                                f"{self.max_image_bytes}")
        try:
            img = PIL.Image.open(io.BytesIO(raw), formats=list(IMAGE_FORMATS))
        except PIL.Image.DecompressionBombError:
            raise refuse(where, f"the image is over max_image_pixels ({self.max_image_pixels})") from None
        except Exception:  # noqa: BLE001 - a decoder meets hostile bytes in many ways
            raise refuse(where, "the data is not an image kvflow reads (PNG, JPEG, WEBP or GIF), "
                                "or it is corrupt") from None
        with img:
            fmt = "JPEG" if img.format == "MPO" else img.format  # a camera's JPEG with previews
            if media_type is not None and self.format_of(media_type, where) != fmt:
                raise refuse(where, f"the data is {fmt}, not {media_type}")
            w, h = img.size
            if w * h > self.max_image_pixels:
                raise refuse(where, f"the image is {w}x{h}, {w * h} pixels; max_image_pixels is "
                                    f"{self.max_image_pixels}")
            try:
                img.load()
                return image_item(img)
            except Exception:  # noqa: BLE001 - truncated or corrupt pixel data
                raise refuse(where, f"the {fmt} image is truncated or corrupt") from None

    def check_image(self, img: PIL.Image.Image, where: str) -> ImageItem:
        """A PIL image handed over in-process (offline `LLM`): bounded like any other."""
        if not isinstance(img, PIL.Image.Image):
            raise refuse(where, f"expected a PIL image, got {type(img).__name__}")
        w, h = img.size
        if w * h > self.max_image_pixels:
            raise refuse(where, f"the image is {w}x{h}, {w * h} pixels; max_image_pixels is "
                                f"{self.max_image_pixels}")
        return image_item(img)
