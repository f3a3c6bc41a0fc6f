"""Single-stream decode through a stack of gpt-oss-shaped expert blocks (gpt-oss-20b's widths:
hidden 2880, 32 experts top-4, expert width 2880; a few layers), the experts in MXFP4 as the
checkpoints store them (kvflow/csrc/gemm_mxfp4.c) against the same blocks in bf16 (the bf16
panel GEMM where the CPU has AVX512-BF16): tokens per second and the expert bytes each token
reads.

    .venv/bin/python benchmarks/mxfp4_decode.py [--layers 2] [--tokens 32] [--threads 1,2] [--rounds 3]

Each token runs through every layer as decode does (h += block(rmsnorm(h)), one row), so every
layer's router picks its own 4 experts; the weights (1.6 GB of bf16 experts a layer) are far
past the last-level cache, as in the whole model. Only the expert blocks run: attention, the
embedding and the LM head are the same for both and left out. Random weights: the MXFP4 panels
are random codes with exponents near gpt-oss's (2^-9..2^-6), the bf16 experts random normals.
Rows are the median of --rounds rounds, the two kinds alternating within a round.

Writes benchmarks/results/<date>-mxfp4-decode.json (results_io's "table" kind)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import kvflow  # noqa: E402,F401 - first, so OMP_WAIT_POLICY applies before torch loads
import torch  # noqa: E402

from kvflow.layers.moe import GptOssMoeBlock  # noqa: E402
from kvflow.model.packed_linear import PackedWeight  # noqa: E402
from kvflow.model.quant.packing import RECORD_BYTES  # noqa: E402
from kvflow.model.quant.qlinear import QuantizedWeight, best_isa  # noqa: E402
from kvflow.model.kernels import select_kernels  # noqa: E402
from kvflow.models.gpt_oss import GptOssArchConfig  # noqa: E402

HIDDEN, EXPERTS, TOP_K, WIDTH = 2880, 32, 4, 2880


def arch(layers: int) -> GptOssArchConfig:
    return GptOssArchConfig(
        architecture="GptOssForCausalLM", vocab_size=32, hidden_size=HIDDEN, intermediate_size=WIDTH,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=150000.0, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=WIDTH, norm_topk_prob=True)


def random_mxfp4(n: int, k: int, isa: str, g: torch.Generator) -> QuantizedWeight:
    """Random panels: any byte is a pair of valid codes; the exponent bytes set near 2^-7."""
    packed = torch.randint(0, 256, (n // 16 * k // 32, RECORD_BYTES["mxfp4"]), dtype=torch.uint8, generator=g)
    packed[:, 256:] = torch.randint(119, 123, (packed.shape[0], 16), dtype=torch.uint8, generator=g)
    return QuantizedWeight(kind="mxfp4", n=n, k=k, packed=packed.reshape(-1), isa=isa, source="MXFP4")


def make_block(a: GptOssArchConfig, kind: str, kernels, isa: str, g: torch.Generator) -> GptOssMoeBlock:
    block = GptOssMoeBlock(a, torch.bfloat16)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name in ("gate_up", "down") and kind == "mxfp4":
                continue
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        block.router.mul_(20)  # decisive routing, as a trained router
    if kind == "mxfp4":
        block.gate_up = torch.nn.Parameter(block.gate_up.to("meta"), requires_grad=False)
        block.down = torch.nn.Parameter(block.down.to("meta"), requires_grad=False)
        block.pack_weights(kernels.pack)
        block.packed_experts = [{"gate_up": PackedWeight(quant=random_mxfp4(2 * WIDTH, HIDDEN, isa, g)),
                                 "down": PackedWeight(quant=random_mxfp4(HIDDEN, WIDTH, isa, g))}
                                for _ in range(EXPERTS)]
    else:
        block.pack_weights(kernels.pack)
        if block.packed_experts[0]["gate_up"] is not None:  # the panels serve: drop the plain copy
            block.gate_up = torch.nn.Parameter(block.gate_up.to("meta"), requires_grad=False)
            block.down = torch.nn.Parameter(block.down.to("meta"), requires_grad=False)
    return block


def decode(blocks: list[GptOssMoeBlock], kernels, tokens: int, g: torch.Generator) -> float:
    """Seconds for `tokens` one-row steps through every block."""
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16)
    h = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(tokens):
            for block in blocks:
                h = h + block(kernels.add_rms_norm(h, None, norm, 1e-5), kernels)
            h = h / h.float().norm().clamp(min=1e-3).to(torch.bfloat16) * 40  # keep the stream's scale
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", default="1,2", help="thread counts, each a row per kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    from results_io import cpu_info, git_commit

    kernels = select_kernels(torch.bfloat16)
    isa = best_isa(kernels.features)
    a, g = arch(args.layers), torch.Generator().manual_seed(0)
    blocks = {kind: [make_block(a, kind, kernels, isa, g) for _ in range(args.layers)] for kind in ("mxfp4", "bf16")}
    expert_bytes = {"mxfp4": 3 * HIDDEN * WIDTH * 17 // 32, "bf16": 3 * HIDDEN * WIDTH * 2}
    router_bytes = EXPERTS * HIDDEN * 2
    print(f"# {cpu_info()['model']}; {kernels.describe()}; mxfp4 via {isa}", flush=True)
    for kind in blocks:  # warm-up: page in every expert once
        decode(blocks[kind], kernels, 8, torch.Generator().manual_seed(1))
    load_before = os.getloadavg()  # the machine's other jobs, for the notes
    rows, speedups = [], []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        times = {kind: [] for kind in blocks}
        for r in range(args.rounds):
            for kind in blocks:
                times[kind].append(decode(blocks[kind], kernels, args.tokens, torch.Generator().manual_seed(2 + r)))
        for kind in blocks:
            s = statistics.median(times[kind])
            per_token = args.layers * (TOP_K * expert_bytes[kind] + router_bytes)
            tok_s = args.tokens / s
            rows.append([kind, threads, round(tok_s, 2), round(1e3 * s / args.tokens, 2),
                         round(per_token / 1e6, 1), round(per_token * tok_s / 1e9, 1)])
            print(rows[-1], flush=True)
        speedups.append(f"{threads} thread(s): {rows[-2][2] / rows[-1][2]:.2f}x")
    print("mxfp4 / bf16 tok/s:", ", ".join(speedups))
    if args.no_write:
        return
    result = {"schema": "kvflow-bench/1", "kind": "table",
              "title": "gpt-oss-shaped expert blocks, single-stream decode: MXFP4 experts vs bf16",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(ROOT),
              "command": "benchmarks/mxfp4_decode.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "source": "this run",
              "notes": [f"{args.layers} layers of gpt-oss-20b's expert block (hidden {HIDDEN}, {EXPERTS} "
                        f"experts top-{TOP_K}, width {WIDTH}), bf16 activations, threads {args.threads}, "
                        f"median of {args.rounds} rounds of {args.tokens} tokens; random weights",
                        f"kernels: {kernels.describe()}; mxfp4 experts via {isa}",
                        "bytes per token: the routed experts' weights and the router, per layer",
                        "a shared machine with other jobs running: timings are noisy (load average "
                        f"{load_before[0]:.1f} before the timed rounds, {os.getloadavg()[0]:.1f} after, "
                        f"on {os.cpu_count()} vCPUs)",
                        "mxfp4 / bf16 tok/s: " + ", ".join(speedups)],
              "columns": ["experts", "threads", "tok/s", "ms/token", "MB read/token", "GB/s"], "rows": rows}
    out = os.path.join(HERE, "results", f"{time.strftime('%Y%m%d-%H%M')}-mxfp4-decode.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
