"""Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): the text decoder of
kvflow/models/gemma3.py, a SigLIP tower (kvflow/layers/siglip.py) and Gemma 3's projector,
which average-pools the tower's patch grid to `mm_tokens_per_image` tokens, RMS-normalises
them (times 1 + weight) and projects them to the decoder's width. Each image's embeddings take
the places of its `<image_soft_token>` run (unscaled, as HF's masked_scatter places them after
the text embedding's sqrt(hidden)), and the run attends bidirectionally within itself in the
prompt (kvflow/attention/bidirectional.py). A folder without a vision config serves its text part."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.siglip import SiglipVisionConfig, SiglipVisionTower, siglip_name
from kvflow.model.arch import LlamaArchConfig
from kvflow.models.gemma3 import Gemma3Family, Gemma3ForCausalLM
from kvflow.models.registry import Supports

_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


@dataclass
class Gemma3VisionArchConfig(LlamaArchConfig):
    """Gemma 3's text fields plus its vision config (None: the folder's text part only)."""

    vision_config: dict | None = None
    mm_tokens_per_image: int = 0
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    image_token_id: int | None = None


class Gemma3MultiModalProjector(nn.Module):
    """The tower's [B, patches, vision hidden] -> [B, mm_tokens_per_image, hidden]."""

    def __init__(self, vision: SiglipVisionConfig, hidden: int, mm_tokens: int):
        super().__init__()
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(mm_tokens ** 0.5)
        if tokens_per_side ** 2 != mm_tokens or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {mm_tokens} does not pool a "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid")
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = vision.layer_norm_eps
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(vision.hidden_size))  # HF's w (x (1 + w))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h = x.shape
        p = self.patches_per_side
        grid = x.transpose(1, 2).reshape(b, h, p, p).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        f = pooled.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The Gemma 3 decoder (one process: no tensor or pipeline split of the tower yet) with
    the vision tower and projector; `embed_multimodal` turns pixel values into the image
    tokens' embeddings, `embed_input_ids` places them (vLLM's SupportsMultiModal names)."""

    supports_images = True

    def __init__(self, arch: Gemma3VisionArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, tp=None, kernels=None, layers: range | None = None):
        if tp is not None or (layers is not None and len(layers) != arch.num_hidden_layers):
            raise ValueError("Gemma 3's vision tower does not run tensor- or pipeline-parallel "
                             "yet; use tensor_parallel_size=1 and pipeline_parallel_size=1")
        super().__init__(arch, dtype, device, max_position, tp, kernels, layers)
        vision = SiglipVisionConfig.from_hf(arch.vision_config)
        self.vision_tower = SiglipVisionTower(vision).to(device=device, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision, arch.hidden_size, arch.mm_tokens_per_image).to(device=device, dtype=dtype)

    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> each image's token embeddings [B, mm_tokens, hidden]."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype)))

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' scaled embeddings, with `multimodal_embeddings` [R, hidden] at the rows
        `is_multimodal` [R] (int64 indices) where given."""
        x = super().embed_input_ids(input_ids)
        if multimodal_embeddings is not None:
            x[is_multimodal] = multimodal_embeddings.to(x.dtype)
        return x


class Gemma3VisionFamily(Gemma3Family):
    """Gemma3ForConditionalGeneration folders: the text family's names and module, plus the
    tower's and projector's tensors where the config has a vision part."""

    config_class = Gemma3VisionArchConfig
    image_processor = "gemma3"
    supports = Supports(tensor_parallel=True, pipeline_parallel=True, lora=False,
                        quantized=False, decode_step=False)

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        fields = super().hf_fields(cfg, architecture)
        vision = cfg.get("vision_config")
        if vision:  # (a folder without one: its text part, as the text family serves it)
            fields.update(vision_config=vision,
                          mm_tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
                          boi_token_id=cfg.get("boi_token_index", cfg.get("boi_token_id")),
                          eoi_token_id=cfg.get("eoi_token_index", cfg.get("eoi_token_id")),
                          image_token_id=cfg.get("image_token_index", cfg.get("image_token_id")))
        return fields

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: Gemma3VisionArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().fuse_weights(hf, arch, dtype)
        if not arch.vision_config:
            return out
        for name, w in hf.items():
            for prefix in _TOWER_PREFIXES:
                if name.startswith(prefix):
                    out["vision_tower." + siglip_name(name[len(prefix):])] = w.to(dtype).contiguous()
            for prefix in _PROJECTOR_PREFIXES:
                if name.startswith(prefix):
                    leaf = name[len(prefix):].replace("mm_soft_emb_norm.weight", "mm_soft_emb_norm")
                    out["multi_modal_projector." + leaf] = w.to(dtype).contiguous()
        return out

    def model_class(self, arch: Gemma3VisionArchConfig) -> type[nn.Module]:
        return Gemma3ForConditionalGeneration if arch.vision_config else Gemma3ForCausalLM


FAMILY = Gemma3VisionFamily()
