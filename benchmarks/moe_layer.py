"""Time one mixture-of-experts block (Qwen3-MoE-shaped: hidden 2048, expert width 768) three ways:

- grouped: kvflow's SparseMoeBlock (tokens sorted by expert, one GEMM per active expert
  through the prepacked kernels, index_add back);
- per-token: the same block token by token (each token through its k experts in turn);
- dense: one dense MLP with the same active parameters (width k * 768), the cost floor the
  grouped path aims at when every expert is busy.

    .venv/bin/python benchmarks/moe_layer.py [--experts 8,64] [--top-k 2,8] [--tokens 1,16,256]
        [--dtype bfloat16] [--threads 1] [--rounds 5]

Rows are medians over rounds; within a round the three run back to back, so host load hits
them alike. Random weights and inputs (routing is then spread about evenly over the experts).
Each way cycles through enough copies of its weights (--min-mib) that they cannot stay in the
CPU's last-level cache between calls, as in a model whose other layers run in between: a
single 19 MiB dense MLP would otherwise be timed from L3 and the expert block from DRAM.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvflow  # noqa: E402,F401 - first, so OMP_WAIT_POLICY applies before torch loads
import torch  # noqa: E402

from kvflow.model.arch import LlamaArchConfig  # noqa: E402
from kvflow.model.cpu_features import cpu_features  # noqa: E402
from kvflow.model.kernels import select_kernels  # noqa: E402
from kvflow.layers.moe import SparseMoeBlock, naive_moe_forward  # noqa: E402


def block_arch(experts: int, top_k: int, hidden: int, width: int) -> LlamaArchConfig:
    return LlamaArchConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=hidden,
        intermediate_size=width, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=None, eos_token_id=None, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=width, norm_topk_prob=True)


def timed(fn, reps: int) -> float:
    """Median ms of `reps` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def make_block(arch: LlamaArchConfig, dtype: torch.dtype, kernels) -> SparseMoeBlock:
    block = SparseMoeBlock(arch, dtype)
    for prm in block.parameters():
        prm.data.copy_(torch.randn_like(prm, dtype=torch.float32) * 0.02)
    if kernels.pack is not None:
        block.pack_weights(kernels.pack)
    return block


def make_dense(width: int, hidden: int, dtype: torch.dtype, kernels) -> tuple:
    gate_up = (torch.randn(2 * width, hidden) * 0.02).to(dtype)
    down = (torch.randn(hidden, width) * 0.02).to(dtype)
    packed = {} if kernels.pack is None else {"gate_up": kernels.pack(gate_up, gate_up=True),
                                              "down": kernels.pack(down)}
    return gate_up, down, packed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,64")
    p.add_argument("--top-k", default="2,8", help="one per --experts entry")
    p.add_argument("--tokens", default="1,16,256")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-mib", type=int, default=256,
                   help="each way's weights, summed over its copies, at least this large")
    p.add_argument("--naive-max-tokens", type=int, default=256,
                   help="skip the per-token loop above this many tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = select_kernels(dtype)
    print(f"# {cpu_features().isa}, {args.threads} thread(s), {args.dtype}; {kernels.describe()}")
    print("| experts | top-k | tokens | grouped ms | per-token ms | dense (same active) ms "
          "| per-token / grouped | grouped / dense |")
    print("|---|---|---|---|---|---|---|---|")
    for experts, top_k in zip(map(int, args.experts.split(",")), map(int, args.top_k.split(","))):
        arch = block_arch(experts, top_k, args.hidden, args.width)
        torch.manual_seed(0)
        itemsize = torch.finfo(dtype).bits // 8
        moe_mib = experts * 3 * args.hidden * args.width * itemsize / 2**20
        dense_mib = top_k * 3 * args.hidden * args.width * itemsize / 2**20
        blocks = [make_block(arch, dtype, kernels) for _ in range(max(1, round(args.min_mib / moe_mib)))]
        denses = [make_dense(top_k * args.width, args.hidden, dtype, kernels)
                  for _ in range(max(1, round(args.min_mib / dense_mib)))]
        turn = {"grouped": 0, "naive": 0, "dense": 0}

        def next_of(kind, items):
            turn[kind] += 1
            return items[turn[kind] % len(items)]

        def grouped(h):
            return next_of("grouped", blocks)(h, kernels)

        def naive(h):
            return naive_moe_forward(next_of("naive", blocks), h, kernels)

        def dense(h):
            w_gate_up, w_down, packed = next_of("dense", denses)
            act = kernels.linear_silu_mul(h, w_gate_up, packed.get("gate_up"))
            return kernels.linear(act, w_down, packed.get("down"))

        for tokens in map(int, args.tokens.split(",")):
            h = torch.randn(tokens, args.hidden).to(dtype)
            rows = {"grouped": [], "naive": [], "dense": []}
            reps = max(1, min(20, 256 // tokens))
            with torch.inference_mode():
                for _ in range(args.rounds):
                    rows["grouped"].append(timed(lambda: grouped(h), reps))
                    if tokens <= args.naive_max_tokens:
                        rows["naive"].append(timed(lambda: naive(h), max(1, reps // 4)))
                    rows["dense"].append(timed(lambda: dense(h), reps))
            g, d = statistics.median(rows["grouped"]), statistics.median(rows["dense"])
            n = statistics.median(rows["naive"]) if rows["naive"] else float("nan")
            print(f"| {experts} | {top_k} | {tokens} | {g:.2f} | {n:.2f} | {d:.2f} | {n / g:.1f}x | {g / d:.2f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
