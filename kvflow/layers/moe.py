"""A mixture-of-experts block (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss) over the flat batch of tokens.

The router scores every token (softmax over all experts in fp32, the top k kept, renormalised
to sum to one where the config says so: transformers' order). Then the (token, expert) pairs
are sorted by expert, so each expert's tokens sit together: every active expert runs once per
step, as one GEMM over all of its tokens through the same `kernels.linear_silu_mul` /
`kernels.linear` path and prepacked weights as a dense MLP; each output row is scaled by its
router weight and the rows are added back to their tokens with one index_add. No loop over
tokens: the Python loop is over the experts that got any token (at most num_experts).

Qwen2-MoE adds a shared expert that every token goes through, scaled by sigmoid(x . w_gate);
a block whose `shared_gate` is None (Granite 4.0-H's shared MLP) adds it unscaled.
gpt-oss (GptOssMoeBlock) differs in the router and the experts only: a router bias, the softmax
over the top-k logits, biases on the experts' projections and a clamped SwiGLU."""
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

    def expert(self, e: int, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """Expert e's output for its rows x (a SwiGLU MLP)."""
        pk = self.packed_experts[e]
        act = kernels.linear_silu_mul(x, self.gate_up[e], pk.get("gate_up"))
        return kernels.linear(act, self.down[e], pk.get("down"))

    def forward(self, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        out = self.dispatch(h, *self.route(h, kernels), kernels)
        if self.shared_gate_up is not None:
            act = kernels.linear_silu_mul(h, self.shared_gate_up, self.packed.get("shared_gate_up"))
            shared = kernels.linear(act, self.shared_down, self.packed.get("shared_down"))
            out += shared if self.shared_gate is None else torch.sigmoid(
                torch.nn.functional.linear(h, self.shared_gate)) * shared
        return out

    def dispatch(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 kernels: Kernels) -> torch.Tensor:
        """The routed experts' weighted sum for each row of h, given its routing (a family
        may route on another input than the one its experts take: Gemma 4)."""
        t, k = h.shape[0], self.top_k
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
            y[rows] = self.expert(e, x[rows], kernels)
            start += n
        y.mul_(weights.reshape(-1)[order].unsqueeze(1))
        return torch.zeros_like(h).index_add_(0, tokens, y)


class GptOssMoeBlock(SparseMoeBlock):
    """gpt-oss's experts, as Hugging Face's GptOssMLP computes them: router logits x . w + b,
    the top k of them softmaxed; each expert's [gate; up] and down with biases, and between them
    the clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate). (HF's checkpoint interleaves gate and up columns;
    the family's loader splits them into kvflow's [gate; up] rows.) The down bias is part of the
    expert's output, so it is scaled by the router weight like the rest."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, device=None):
        super().__init__(arch, dtype, device)
        e, h, inter = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.router_bias = weight(e, dtype=dtype, device=device)
        self.gate_up_bias = weight(e, 2 * inter, dtype=dtype, device=device)
        self.down_bias = weight(e, h, dtype=dtype, device=device)
        self.alpha, self.limit = arch.swiglu_alpha, arch.swiglu_limit

    def pack_weights(self, pack) -> None:
        self.packed = {"router": pack(self.router)}
        if self.gate_up.is_meta:  # MXFP4 experts as stored: their loader sets packed_experts
            return
        # [gate; up] packed as a plain projection: the activation is not SiLU
        self.packed_experts = [{"gate_up": pack(self.gate_up[e]), "down": pack(self.down[e])}
                               for e in range(self.num_experts)]

    def route(self, h: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        logits = kernels.linear(h, self.router, self.packed.get("router"), self.router_bias)
        top, experts = torch.topk(logits.float(), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(h.dtype), experts

    def expert(self, e: int, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        pk = self.packed_experts[e]
        gate, up = kernels.linear(x, self.gate_up[e], pk.get("gate_up"), self.gate_up_bias[e]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        act = (up.clamp(-self.limit, self.limit) + 1) * glu
        return kernels.linear(act, self.down[e], pk.get("down"), self.down_bias[e])


def naive_moe_forward(block: SparseMoeBlock, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """The same block computed token by token (each token through its k experts in turn): the
    baseline that benchmarks/moe_layer.py measures the grouped forward against, and a second
    reference for the tests."""
    weights, experts = block.route(h, kernels)
    out = torch.zeros_like(h)
    for i in range(h.shape[0]):
        row = h[i:i + 1]
        for w, e in zip(weights[i].tolist(), experts[i].tolist()):
            out[i] += w * block.expert(e, row, kernels)[0]
    if block.shared_gate_up is not None:
        act = kernels.linear_silu_mul(h, block.shared_gate_up, block.packed.get("shared_gate_up"))
        shared = kernels.linear(act, block.shared_down, block.packed.get("shared_down"))
        out += shared if block.shared_gate is None else torch.sigmoid(
            torch.nn.functional.linear(h, block.shared_gate)) * shared
    return out
