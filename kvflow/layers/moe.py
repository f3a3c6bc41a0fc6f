"""A mixture-of-experts block (Qwen3-MoE, Mixtral, Qwen2-MoE) over the flat batch of tokens.

The router scores every token (softmax over all experts in fp32, the top k kept, renormalised
to sum to one where the config says so: transformers' order). Then the (token, expert) pairs
are sorted by expert, so each expert's tokens sit together: every active expert runs once per
step, as one GEMM over all of its tokens through the same `kernels.linear_silu_mul` /
`kernels.linear` path and prepacked weights as a dense MLP; each output row is scaled by its
router weight and the rows are added back to their tokens with one index_add. No loop over
tokens: the Python loop is over the experts that got any token (at most num_experts).

Qwen2-MoE adds a shared expert that every token goes through, scaled by sigmoid(x . w_gate);
a block whose `shared_gate` is None (Granite 4.0-H's shared MLP) adds it unscaled."""
from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.parameter import weight
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kernels import Kernels
from kvflow.model.packed_linear import PackedWeight


class SparseMoeBlock(nn.Module):
    """Router [E, H], experts' [gate; up] [E, 2I, H] and down [E, H, I], optional shared
    expert. forward(h) -> the block's output [T, H] (before the residual add)."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None):
        super().__init__()
        h, e, inter = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = e, arch.num_experts_per_tok, arch.norm_topk_prob
        self.router = weight(e, h, dtype=dtype, device=device)
        self.gate_up = weight(e, 2 * inter, h, dtype=dtype, device=device)
        self.down = weight(e, h, inter, dtype=dtype, device=device)
        shared = arch.shared_expert_intermediate_size
        self.shared_gate_up = weight(2 * shared, h, dtype=dtype, device=device) if shared else None
        self.shared_down = weight(h, shared, dtype=dtype, device=device) if shared else None
        self.shared_gate = weight(1, h, dtype=dtype, device=device) if shared else None
        self.packed: dict[str, PackedWeight | None] = {}
        self.packed_experts: list[dict[str, PackedWeight | None]] = [{} for _ in range(e)]

    def pack_weights(self, pack) -> None:
        """Prepack every expert's projections (and the router and shared expert) like the dense
        layers' (`pack` is Kernels.pack)."""
        self.packed_experts = [{"gate_up": pack(self.gate_up[e], gate_up=True), "down": pack(self.down[e])}
                               for e in range(self.num_experts)]
        self.packed = {"router": pack(self.router)}
        if self.shared_gate_up is not None:
            self.packed.update(shared_gate_up=pack(self.shared_gate_up, gate_up=True),
                               shared_down=pack(self.shared_down))

    def route(self, h: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in h's dtype, experts [T, k] int64) for each token."""
        logits = kernels.linear(h, self.router, self.packed.get("router"))
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        t, k = h.shape[0], self.top_k
        weights, experts = self.route(h, kernels)
        flat = experts.reshape(-1)  # pair j = (token j // k, its (j % k)-th expert)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x = h.index_select(0, tokens)  # the pairs' inputs, grouped by expert
        y = h.new_empty(t * k, h.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            pk = self.packed_experts[e]
            act = kernels.linear_silu_mul(x[rows], self.gate_up[e], pk.get("gate_up"))
            y[rows] = kernels.linear(act, self.down[e], pk.get("down"))
            start += n
        y.mul_(weights.reshape(-1)[order].unsqueeze(1))
        out = torch.zeros_like(h).index_add_(0, tokens, y)
        if self.shared_gate_up is not None:
            act = kernels.linear_silu_mul(h, self.shared_gate_up, self.packed.get("shared_gate_up"))
            shared = kernels.linear(act, self.shared_down, self.packed.get("shared_down"))
            out += shared if self.shared_gate is None else torch.sigmoid(
                torch.nn.functional.linear(h, self.shared_gate)) * shared
        return out


def naive_moe_forward(block: SparseMoeBlock, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """The same block computed token by token (each token through its k experts in turn): the
    baseline that benchmarks/moe_layer.py measures the grouped forward against, and a second
    reference for the tests."""
    weights, experts = block.route(h, kernels)
    out = torch.zeros_like(h)
    for i in range(h.shape[0]):
        row = h[i:i + 1]
        for w, e in zip(weights[i].tolist(), experts[i].tolist()):
            pk = block.packed_experts[e]
            act = kernels.linear_silu_mul(row, block.gate_up[e], pk.get("gate_up"))
            out[i] += w * kernels.linear(act, block.down[e], pk.get("down"))[0]
    if block.shared_gate_up is not None:
        act = kernels.linear_silu_mul(h, block.shared_gate_up, block.packed.get("shared_gate_up"))
        shared = kernels.linear(act, block.shared_down, block.packed.get("shared_down"))
        out += shared if block.shared_gate is None else torch.sigmoid(
            torch.nn.functional.linear(h, block.shared_gate)) * shared
    return out
