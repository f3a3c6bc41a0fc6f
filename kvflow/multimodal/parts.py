"""A chat message's content parts as the chat template takes them, and its images in order.

OpenAI's parts come in as `{"type": "text", "text": ...}` and `{"type": "image_url",
"image_url": {"url": ...}}` (offline, also vLLM's `{"type": "image_pil", "image_pil": image}`).
The template gets the text joined into a string when a message has no image (as before), else
a list of `{"type": "text", "text": ...}` and `{"type": "image"}` in order: transformers'
convention, which a vision model's template turns into its image token (Gemma 3's
`<start_of_image>`). Each image part becomes an ImageRef naming where it was, so that reading it
(media.py) and every check of it can name the part."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.request import InvalidRequestError


@dataclass(frozen=True)
class ImageRef:
    """One image part not yet read: its URL (or, offline, the PIL image itself) and its place."""

    where: str  # "messages[0].content[1]"
    url: str | None = None
    image: Any = None  # a PIL image given in-process


def template_content(content: Any, where: str, refs: list[ImageRef], offline: bool = True) -> Any:
    """`content` (a string, None, or a list of parts) as the template takes it; image parts are
    appended to `refs`. ValueError naming the part for one that cannot be read. `image_pil`
    parts (a PIL image in-process) only `offline`."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: content must be a string or a list of parts", where)
    parts: list[dict] = []
    has_image = False
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{at}.text: a text part needs its text", at)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url" or (kind == "image_pil" and offline):
            refs.append(_image_ref(part, kind, at))
            parts.append({"type": "image"})
            has_image = True
        else:
            raise InvalidRequestError(
                f"{at}.type: content part of type {str(kind)[:64]!r} is not supported (text, "
                "image_url)", at)
    if not has_image:
        return "".join(p["text"] for p in parts)
    return parts


def _image_ref(part: dict, kind: str, at: str) -> ImageRef:
    if kind == "image_pil":
        return ImageRef(at, image=part.get("image_pil"))
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise InvalidRequestError(f"{at}.image_url.url: an image_url part needs its url", at)
    detail = spec.get("detail") if isinstance(spec, dict) else None
    if detail not in (None, "auto"):
        # OpenAI's low/high resize the image for its own models; a kvflow model's processor
        # decides its input size, so that request cannot be honoured
        raise InvalidRequestError(f"{at}.image_url.detail: {str(detail)[:16]!r} is not "
                                  "supported (only auto; the model's processor sizes images)", at)
    return ImageRef(at, url=url)


def conversation_images(messages: list[dict], where: str = "messages"
                        ) -> tuple[list[dict], list[ImageRef]]:
    """Plain-dict messages (LLM.chat's) with their content as the template takes it, and the
    image parts in order."""
    refs: list[ImageRef] = []
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{where}[{i}]: a message is a dict", f"{where}[{i}]")
        content = template_content(m.get("content"), f"{where}[{i}].content", refs)
        out.append({**m, "content": content} if "content" in m else dict(m))
    return out, refs
