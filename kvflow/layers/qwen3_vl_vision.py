"""The Qwen3-VL vision encoder, as Hugging Face's Qwen3VLVisionModel computes it: patches of
`temporal_patch_size` frames x patch x patch pixels embedded by a strided 3D convolution, learned
position embeddings on a square grid resampled bilinearly (corners aligned) to each image's
patch grid, 2D RoPE (height and width halves of each head), pre-norm blocks attending within
each image, and the 2 x 2 patch merger (LayerNorm, then an MLP over the four merged patches).
DeepStack: mergers of their own (normed after the merge) turn chosen blocks' outputs into
features the decoder adds to its image tokens' hidden states after its first layers.

Patches arrive in the image processor's order: 2 x 2 merge blocks, block-major, so a merged
token is four consecutive patches."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3VLVisionConfig":
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"a Qwen3-VL vision tower with hidden_act {act!r} is not supported")
        rope = cfg.get("rope_parameters") or {}
        return cls(cfg["depth"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_heads"],
                   cfg["patch_size"], cfg.get("temporal_patch_size", 2), cfg.get("spatial_merge_size", 2),
                   cfg["out_hidden_size"], cfg["num_position_embeddings"],
                   tuple(cfg.get("deepstack_visual_indexes") or ()), cfg.get("in_channels", 3),
                   float(rope.get("rope_theta", 10000.0)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, c: Qwen3VLVisionConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_heads
        self.norm1 = nn.LayerNorm(h, eps=1e-6)
        self.norm2 = nn.LayerNorm(h, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.linear_fc1 = nn.Linear(h, c.intermediate_size)
        self.linear_fc2 = nn.Linear(c.intermediate_size, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)  # [N, heads, D]
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        # 4-D [1, heads, N, D]: PyTorch's CPU flash kernel takes only 4-D inputs (3-D ones fall
        # back to the math path, which materialises the N x N scores: 2-3x the ViT's time)
        outs = [F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None],
                                               vi.transpose(0, 1)[None])[0]
                for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        a = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, h)  # each image attends to itself
        x = x + self.proj(a)
        return x + self.linear_fc2(F.gelu(self.linear_fc1(self.norm2(x)), approximate="tanh"))


class Qwen3VLPatchMerger(nn.Module):
    """Four merged patches -> one decoder-width token; `postshuffle`: normed after the merge."""

    def __init__(self, c: Qwen3VLVisionConfig, postshuffle: bool):
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionEncoder(nn.Module):
    """Images' patches [N, C * T * P * P] with their grids [(t, h, w), ...] (in patches) ->
    (merged tokens [N / merge^2, out_hidden], DeepStack features, one such tensor per index)."""

    def __init__(self, c: Qwen3VLVisionConfig):
        super().__init__()
        self.config = c
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Conv3d(c.in_channels, c.hidden_size, kernel, kernel)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(c) for _ in range(c.depth))
        self.merger = Qwen3VLPatchMerger(c, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(c, postshuffle=True) for _ in c.deepstack_visual_indexes)
        d = c.hidden_size // c.num_heads // 2  # each spatial axis takes half of a head's dims
        # fp32 on the CPU (a plain attribute: loading onto the meta device leaves it be)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def _grid_coords(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, col) in its image, in merge-block order, and its image's (h, w)."""
        m = self.config.spatial_merge_size
        rows, cols, sizes = [], [], []
        for t, h, w in grids:
            r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
            cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
            sizes.append(torch.tensor([h, w]).expand(t * h * w, 2))
        return torch.stack((torch.cat(rows), torch.cat(cols)), dim=1), torch.cat(sizes)

    def _position_embeddings(self, coords: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The learned side x side table resampled bilinearly (corners aligned) at each patch."""
        side = self.side
        src = coords.float() * (side - 1) / (sizes - 1).clamp(min=1).float()  # [N, 2]
        lo = src.floor()
        frac = src - lo
        lo = lo.long().clamp(0, side - 1)
        hi = (lo + 1).clamp(max=side - 1)
        table = self.pos_embed.weight
        out = 0
        for r, wr in ((lo[:, 0], 1 - frac[:, 0]), (hi[:, 0], frac[:, 0])):
            for c, wc in ((lo[:, 1], 1 - frac[:, 1]), (hi[:, 1], frac[:, 1])):
                out = out + table[r * side + c] * (wr * wc)[:, None].to(table.dtype)
        return out

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        w = self.patch_embed.weight
        x = self.patch_embed(patches.to(w.dtype).view(-1, c.in_channels, c.temporal_patch_size,
                                                     c.patch_size, c.patch_size)).view(-1, c.hidden_size)
        coords, sizes = self._grid_coords(grids)
        x = x + self._position_embeddings(coords.to(x.device), sizes.to(x.device)).to(x.dtype)
        freqs = coords.to(x.device)[..., None].float() * self.inv_freq.to(x.device)  # [N, 2, d / 2]
        emb = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        lengths = [t * h * w_ for t, h, w_ in grids]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in c.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
