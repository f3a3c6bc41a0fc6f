"""The ceiling this machine's GEMM rate puts on the default model: measured F.linear rates at
the model's own shapes (batch 64 for decode, 2048-token prefill chunks), turned into tokens/s.

    .venv/bin/python benchmarks/roofline.py [--threads 1] [--dtype float32] [--input-tokens N]

Decode at batch 64 costs 64 x (projections + LM head) FLOPs per step; W1's roofline adds the
prompt tokens' projections (no LM head: logits only where a request samples). Attention and
everything else are left out, so real engines stay below these numbers."""
from __future__ import annotations

import argparse
import json
import time

import kvflow  # noqa: F401 - before torch, so OMP_WAIT_POLICY=PASSIVE applies to the two-thread rates

H, I, Q, KV, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152  # SmolLM2-135M
SHAPES = [(Q + 2 * KV, H), (H, Q), (2 * I, H), (H, I)]  # (out, in): qkv, o, gate_up, down


def flops_per_token(with_logits: bool) -> float:
    return LAYERS * sum(2 * o * i for o, i in SHAPES) + (2 * H * VOCAB if with_logits else 0)


def rate(m: int, dtype, reps: int = 5) -> float:
    """GFLOP/s of one forward's worth of GEMMs at batch m (LM head included), each shape by
    the faster of MKL's F.linear and oneDNN's prepacked linear (what kvflow uses in fp32)."""
    import torch
    import torch.nn.functional as F

    def best_time(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    total_s, fl = 0.0, 0
    for o, i in SHAPES + [(VOCAB, H)]:
        w, x = torch.randn(o, i).to(dtype), torch.randn(m, i).to(dtype)
        t = best_time(lambda: F.linear(x, w))
        if dtype == torch.float32 and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            t = min(t, best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")))
        total_s += t
        fl += 2 * m * o * i
    return fl / total_s / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=33394, help="W1's prompt tokens (seed 0)")
    p.add_argument("--output-tokens", type=int, default=128 * 128)
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    r_dec = rate(args.batch, dtype)
    r_pre = rate(512 if dtype == torch.bfloat16 else 2048, dtype, reps=2)
    w1_s = (args.input_tokens * flops_per_token(False) / (r_pre * 1e9)
            + args.output_tokens * flops_per_token(True) / (r_dec * 1e9))
    print(json.dumps({
        "threads": args.threads, "dtype": args.dtype,
        "gemm_gflops_batch": r_dec, "gemm_gflops_prefill": r_pre,
        "decode_tok_s_at_batch": r_dec * 1e9 / flops_per_token(True), "batch": args.batch,
        "w1_wall_s": w1_s, "w1_output_tok_s": args.output_tokens / w1_s,
        "w1_total_tflop": (args.input_tokens * flops_per_token(False)
                           + args.output_tokens * flops_per_token(True)) / 1e12}))


if __name__ == "__main__":
    main()
