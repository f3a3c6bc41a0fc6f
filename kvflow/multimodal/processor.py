"""A model's image processing (vLLM's multimodal processor), once per request at the engine's
door: the prompt's token ids, with one image-start token per image as the chat template
renders it, and the request's ImageItems -> the expanded token ids and one feature per image
(its placeholder run, content hash and pixel values from transformers' image processor).

Gemma 3 (HF's Gemma3Processor): each `<start_of_image>` becomes "\\n\\n", `<start_of_image>`,
`mm_tokens_per_image` x `<image_soft_token>`, `<end_of_image>`, "\\n\\n"; the image is resized
to the tower's square (no pan-and-scan crops), rescaled and normalised. The run of soft tokens
is the placeholder the image's embeddings replace. Here the expansion is done on token ids
("\\n\\n" as the tokenizer encodes it alone), so a newline written right before the image
part stays its own token where HF's text-level expansion could merge it with the "\\n\\n"."""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from kvflow.models.registry import family_of
from kvflow.multimodal.inputs import ImageItem
from kvflow.request import InvalidRequestError, MultiModalFeatureSpec, PlaceholderRange


class Gemma3MultiModalProcessor:
    """Built once per engine from the model folder (its preprocessor_config.json), the model's
    architecture (its image token ids, tokens per image) and the tokenizer."""

    RECENT = 8  # images whose pixel values are kept

    def __init__(self, model_path: str, arch, tokenizer) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.boi, self.eoi, self.image = arch.boi_token_id, arch.eoi_token_id, arch.image_token_id
        self.num_tokens = arch.mm_tokens_per_image
        self.newlines = list(tokenizer.encode("\n\n", add_special_tokens=False))
        # the last few images' pixel values by content hash: a prompt checked before it is
        # queued, or an image sent again, is not preprocessed twice
        self._recent: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the server processes requests in threads

    def pixel_values(self, item: ImageItem) -> np.ndarray:
        """One image's [C, H, W] float32 pixel values, as the HF processor makes them."""
        with self._lock:
            px = self._recent.get(item.content_hash)
            if px is not None:
                self._recent.move_to_end(item.content_hash)
                return px
        out = self.image_processor([item.image], return_tensors="np", do_pan_and_scan=False)
        px = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        with self._lock:
            self._recent[item.content_hash] = px
            if len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
        return px

    def apply(self, prompt_token_ids: list[int],
              mm_data: dict[str, list[ImageItem]]) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(expanded token ids, one feature per image in order); InvalidRequestError naming
        multi_modal_data when the images and the prompt's image-start tokens do not pair up."""
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise InvalidRequestError(f"multi_modal_data: {', '.join(sorted(unknown))} is not "
                                      "supported (only image)", "multi_modal_data")
        images = list(mm_data.get("image") or [])
        starts = sum(1 for t in prompt_token_ids if t == self.boi)
        if starts != len(images):
            raise InvalidRequestError(
                f"multi_modal_data: {len(images)} image(s) but the prompt has {starts} image "
                f"start token(s) ({self.boi})", "multi_modal_data")
        if any(t in (self.image, self.eoi) for t in prompt_token_ids):
            raise InvalidRequestError("prompt: image and end-of-image tokens come from the "
                                      "images, not the prompt", "prompt")
        ids: list[int] = []
        features = []
        it = iter(images)
        for t in prompt_token_ids:
            if t != self.boi:
                ids.append(t)
                continue
            item = next(it)
            ids += self.newlines + [self.boi]
            offset = len(ids)
            ids += [self.image] * self.num_tokens + [self.eoi] + self.newlines
            px = self.pixel_values(item)
            features.append(MultiModalFeatureSpec("image", item.content_hash,
                                                  PlaceholderRange(offset, self.num_tokens),
                                                  px.tobytes(), tuple(px.shape)))
        return ids, features


class Qwen3VLMultiModalProcessor:
    """Qwen3-VL (HF's Qwen3VLProcessor): each `<|image_pad|>` (the chat template writes it
    between `<|vision_start|>` and `<|vision_end|>`) becomes one token per merged patch of its
    image, which the image processor resizes to a multiple of patch x merge pixels within its
    pixel bounds: t x h x w patches, (h / merge) x (w / merge) tokens."""

    def __init__(self, model_path: str, arch, tokenizer) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image = arch.image_token_id
        self.merge = int(arch.vision_config.get("spatial_merge_size", 2))

    def apply(self, prompt_token_ids: list[int],
              mm_data: dict[str, list[ImageItem]]) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        images = _images_of(mm_data)
        pads = sum(1 for t in prompt_token_ids if t == self.image)
        if pads != len(images):
            raise InvalidRequestError(
                f"multi_modal_data: {len(images)} image(s) but the prompt has {pads} image "
                f"token(s) ({self.image})", "multi_modal_data")
        ids: list[int] = []
        features = []
        it = iter(images)
        for tok in prompt_token_ids:
            if tok != self.image:
                ids.append(tok)
                continue
            item = next(it)
            out = self.image_processor([item.image], return_tensors="np")
            px = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            grid = (t, h // self.merge, w // self.merge)
            n = grid[0] * grid[1] * grid[2]
            features.append(MultiModalFeatureSpec(
                "image", item.content_hash, PlaceholderRange(len(ids), n), px.tobytes(),
                (t, h, w, px.shape[-1]), grid))
            ids += [self.image] * n
        return ids, features


def _images_of(mm_data: dict[str, list[ImageItem]]) -> list[ImageItem]:
    unknown = set(mm_data) - {"image"}
    if unknown:
        raise InvalidRequestError(f"multi_modal_data: {', '.join(sorted(unknown))} is not "
                                  "supported (only image)", "multi_modal_data")
    return list(mm_data.get("image") or [])


PROCESSORS = {"gemma3": Gemma3MultiModalProcessor, "qwen3_vl": Qwen3VLMultiModalProcessor}


def multimodal_processor(model_path: str, arch, tokenizer):
    """The image processing of a model that takes images (None for one that does not): the
    one its family names."""
    if not getattr(arch, "vision_config", None):
        return None
    name = family_of(arch.architecture).image_processor
    return None if name is None else PROCESSORS[name](model_path, arch, tokenizer)
