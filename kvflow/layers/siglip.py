"""The SigLIP vision encoder (the vision tower of Gemma 3), as Hugging Face's SiglipVisionModel
computes it without its pooling head: patches embedded by a strided convolution plus learned
position embeddings, pre-norm encoder layers (LayerNorm, bidirectional multi-head attention
with biases, LayerNorm, a gelu-tanh MLP), a final LayerNorm. Images are few and small next to
the decoder's work, so it runs as plain PyTorch over a batch of whole images."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipVisionConfig:
    """The fields of transformers' SiglipVisionConfig the tower reads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, cfg: dict) -> "SiglipVisionConfig":
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"a SigLIP vision tower with hidden_act {act!r} is not supported "
                             "(gelu_pytorch_tanh)")
        return cls(**{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "image_size", "patch_size")},
                   num_channels=cfg.get("num_channels", 3),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-6))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class SiglipEncoderLayer(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1 = nn.Linear(h, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        y = self.layer_norm1(x)
        q, k, v = (p(y).view(b, n, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, n, h))
        y = self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))
        return x + y


class SiglipVisionTower(nn.Module):
    """pixel_values [B, C, H, W] -> the last hidden state [B, num_patches, hidden]."""

    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.config = c
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size)
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)
        self.layers = nn.ModuleList(SiglipEncoderLayer(c) for _ in range(c.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


# HF's tensor names under the tower (after `vision_tower.` and an optional `vision_model.`)
# -> this module's
_HF_LAYER = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
             "self_attn.out_proj": "out_proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2",
             "layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2"}


def siglip_name(hf_name: str) -> str:
    """A tower tensor's HF name relative to the tower (`embeddings.patch_embedding.weight`,
    `encoder.layers.0.self_attn.q_proj.bias`, `post_layernorm.weight`) -> this module's."""
    name = hf_name.removeprefix("vision_model.")
    if name.startswith("embeddings."):
        return name[len("embeddings."):]
    if name.startswith("encoder.layers."):
        i, rest = name[len("encoder.layers."):].split(".", 1)
        part, leaf = rest.rsplit(".", 1)
        return f"layers.{i}.{_HF_LAYER[part]}.{leaf}"
    return name
