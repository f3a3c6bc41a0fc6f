"""Qwen3-VL (Qwen3VLForConditionalGeneration, dense): the Qwen3 decoder of kvflow/models/llama.py
with interleaved M-RoPE and DeepStack, and its vision encoder (kvflow/layers/qwen3_vl_vision.py).

M-RoPE: each token has three positions (time, height, width); a text token's three are equal,
an image's tokens take their grid coordinates offset by where the image starts, and the text
after an image goes on from the image's largest extent (HF's get_rope_index). The rotary
frequencies take the height and width positions at every third index within their sections
(`mrope_section`), the time position elsewhere. `mrope_positions` gives any token range of a
request from its images alone, so that prompt chunks, decodes and recomputation after a
preemption all see HF's positions. DeepStack: after each of the first decoder layers, the
image tokens' hidden states get the matching vision block's merged features added.
Its attention stays causal over image tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.qwen3_vl_vision import Qwen3VLVisionConfig, Qwen3VLVisionEncoder
from kvflow.layers.rotary import rope_inv_freq
from kvflow.model.arch import LlamaArchConfig
from kvflow.models.family import getter
from kvflow.models.llama import LlamaFamily, LlamaForCausalLM
from kvflow.models.registry import Supports

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("model.visual.", "visual.")


@dataclass
class Qwen3VLArchConfig(LlamaArchConfig):
    vision_config: dict | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, int, int] = (24, 20, 20)


def mrope_positions(features, start: int, end: int) -> np.ndarray:
    """[3, end - start] int64: the M-RoPE positions of tokens start..end-1 of a request whose
    images are `features` (request.MultiModalFeatureSpec, shape (t, h, w, patch) in merged
    tokens' grid x merge): text at its index plus the shift of the images before it, an
    image's tokens at their (t, h, w) coordinates from where it starts."""
    idx = np.arange(start, end, dtype=np.int64)
    pos = np.broadcast_to(idx, (3, len(idx))).copy()
    shift = 0
    for f in features:
        t, h, w = f.grid
        if f.offset < end and f.end > start:  # its tokens in this range
            k = np.arange(max(start, f.offset), min(end, f.end)) - f.offset
            tt, rest = np.divmod(k, h * w)
            hh, ww = np.divmod(rest, w)
            base = f.offset + shift
            cols = k + f.offset - start
            pos[0, cols], pos[1, cols], pos[2, cols] = base + tt, base + hh, base + ww
        shift += max(h, w) - f.length
        pos[:, idx >= f.end] += max(h, w) - f.length
    return pos


class Qwen3VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen3 decoder (one process) with M-RoPE, DeepStack and the vision encoder."""

    supports_images = True
    bidirectional_images = False  # its image tokens attend causally
    uses_mrope = True

    def __init__(self, arch: Qwen3VLArchConfig, dtype: torch.dtype, device=None,
                 max_position: int | None = None, tp=None, kernels=None, layers: range | None = None):
        if tp is not None or (layers is not None and len(layers) != arch.num_hidden_layers):
            raise ValueError("Qwen3-VL does not run tensor- or pipeline-parallel yet; use "
                             "tensor_parallel_size=1 and pipeline_parallel_size=1")
        super().__init__(arch, dtype, device, max_position, tp, kernels, layers)
        self.vision = Qwen3VLVisionConfig.from_hf(arch.vision_config)
        self.visual = Qwen3VLVisionEncoder(self.vision).to(device=device, dtype=dtype)
        self.register_buffer("mrope_inv_freq", rope_inv_freq(arch), persistent=False)
        self._deepstack = None  # (rows, [rows, layers, hidden]) for the next forward

    def mrope_positions(self, features, start: int, end: int) -> np.ndarray:
        return mrope_positions(features, start, end)

    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, t, h, w, patch] (images of one grid) -> [B, tokens, hidden * (1 + DeepStack)]:
        each image's merged tokens with its DeepStack features beside them."""
        b, t, h, w, _ = pixel_values.shape
        out = []
        for px in pixel_values:
            merged, deep = self.visual(px.reshape(t * h * w, -1), [(t, h, w)])
            out.append(torch.cat([merged, *deep], dim=-1))
        return torch.stack(out)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' embeddings with the images' merged tokens at the rows `is_multimodal`;
        their DeepStack features are kept for the forward that follows."""
        x = F.embedding(input_ids, self.embed_tokens)
        if multimodal_embeddings is not None:
            h = self.arch.hidden_size
            x[is_multimodal] = multimodal_embeddings[:, :h].to(x.dtype)
            deep = multimodal_embeddings[:, h:].reshape(len(is_multimodal), -1, h).to(x.dtype)
            self._deepstack = (is_multimodal, deep)
        return x

    def _mrope_tables(self, pos: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token cos/sin [T, head_dim] of its three positions, interleaved by section."""
        p = torch.from_numpy(pos).to(self.mrope_inv_freq.device).float()
        freqs = p[..., None] * self.mrope_inv_freq  # [3, T, d / 2]
        thw = freqs[0].clone()
        for axis in (1, 2):
            sl = slice(axis, self.arch.mrope_section[axis] * 3, 3)
            thw[:, sl] = freqs[axis][:, sl]
        emb = torch.cat((thw, thw), dim=-1)
        return emb.cos().contiguous(), emb.sin().contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | np.ndarray,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata | list[AttentionMetadata],
                hidden: torch.Tensor | None = None, lora=None,
                inputs_embeds: torch.Tensor | None = None,
                mrope_positions: np.ndarray | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward, with each token's M-RoPE positions (`mrope_positions`
        [3, T]; text only: its sequence positions) and the DeepStack features of the images
        placed by embed_input_ids."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        deepstack, self._deepstack = self._deepstack, None
        if mrope_positions is None:
            pos = positions if isinstance(positions, np.ndarray) else positions.numpy()
            mrope_positions = np.broadcast_to(np.asarray(pos, dtype=np.int64), (3, len(pos)))
        cos, sin = self._mrope_tables(mrope_positions)
        metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        rows = np.arange(x.shape[0], dtype=np.int64)  # one table row per token
        if metas[0].device_positions is not None:  # on a GPU: the kernels read device tensors
            rows = torch.from_numpy(rows).to(x.device)
        rope = (rows, cos.to(x.device), sin.to(x.device))
        kernels, delta = self.kernels, None
        for i, (layer, kv_cache, meta) in enumerate(zip(self.layers, kv_caches, metas)):
            x, delta = layer(x, delta, rope, kv_cache, meta, kernels, lora)
            if deepstack is not None and i < deepstack[1].shape[1]:
                rows, deep = deepstack
                x, delta = x + delta, None
                x[rows] += deep[:, i]
        return kernels.add_rms_norm(x, delta, self.norm, self.arch.rms_norm_eps)


def _text_name(name: str) -> str:
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def _vision_name(name: str) -> str:
    """HF's tower tensor name (after `visual.`) -> Qwen3VLVisionEncoder's."""
    return name.replace("patch_embed.proj.", "patch_embed.").replace(".attn.", ".").replace(".mlp.", ".")


class Qwen3VLFamily(LlamaFamily):
    name = "Qwen3-VL"
    config_class = Qwen3VLArchConfig
    image_processor = "qwen3_vl"
    supports = Supports(tensor_parallel=False, pipeline_parallel=False, lora=False,
                        quantized=False, decode_step=False)

    def hf_fields(self, cfg: dict, architecture: str) -> dict:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        section = tuple(rope.get("mrope_section") or (24, 20, 20))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3-VL with rope_type {rope.get('rope_type')!r} is not supported")
        if cfg.get("num_experts"):
            raise ValueError("Qwen3-VL with experts (Qwen3VLMoe) is not supported yet")
        return {"qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False)),
                "rope_scaling": None, "vision_config": cfg.get("vision_config"),
                "image_token_id": cfg.get("image_token_id"), "mrope_section": section}

    def hf_name(self, stored: str) -> str:
        return _text_name(stored)

    def fuse_weights(self, hf: dict[str, torch.Tensor], arch: Qwen3VLArchConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().fuse_weights({_text_name(k): v for k, v in hf.items()}, arch, dtype)
        get = getter(hf, dtype)
        for name in hf:
            for prefix in _VISION_PREFIXES:
                if name.startswith(prefix):
                    out["visual." + _vision_name(name[len(prefix):])] = get(name).contiguous()
        return out

    def model_class(self, arch: Qwen3VLArchConfig) -> type[nn.Module]:
        if not arch.vision_config:
            raise ValueError("a Qwen3-VL folder without its vision_config")
        return Qwen3VLForConditionalGeneration


FAMILY = Qwen3VLFamily()
