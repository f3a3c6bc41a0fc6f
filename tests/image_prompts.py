"""The vision tests' inputs: a random image (an ImageItem) and an offline prompt of token ids
with its images, as LLM.generate takes them."""
from __future__ import annotations

import numpy as np
from PIL import Image

from kvflow.multimodal.inputs import image_item


def random_image(h: int, w: int, seed: int):
    rng = np.random.default_rng(seed)
    return image_item(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def mm_prompt(p):
    """(token ids, images) -> LLM.generate's prompt (plain ids where there is no image)."""
    ids, images = p
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
