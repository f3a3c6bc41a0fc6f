"""The image a request carries once its source has been read, checked and decoded: what every
entry point hands the engine as `multi_modal_data={"image": [ImageItem, ...]}`."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import PIL.Image


@dataclass(frozen=True)
class ImageItem:
    image: PIL.Image.Image  # decoded, RGB, bounded
    content_hash: str  # sha256 hex of mode+size+pixel bytes


MultiModalData = dict[str, list[ImageItem]]  # only key "image" for now


def image_item(img: PIL.Image.Image) -> ImageItem:
    """An RGB copy of `img` and the hash of its pixels (the prefix cache's key for it)."""
    rgb = img.convert("RGB")
    h = hashlib.sha256()
    h.update(rgb.mode.encode())
    h.update(f"{rgb.size[0]}x{rgb.size[1]}".encode())
    h.update(rgb.tobytes())
    return ImageItem(image=rgb, content_hash=h.hexdigest())
