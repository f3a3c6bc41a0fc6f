"""The bytes a batch-1 decode step reads from the packed weights of a Llama-3.2-1B-shaped GGUF
file (16 layers, hidden 2048, 32/8 heads of 64, FFN 8192, vocab 128256, tied embedding read
as the LM head), per file type: the GGUF tensors' own bytes (what llama.cpp reads), kvflow's
records before (q4 320 B and q8 608 B per 16 x 32, Q4_0 with a stored min, Q6_K widened to
q8) and now (kvflow/model/quant/packing.py's packed_bytes of the kinds the loader picks).

    python benchmarks/quant_bytes_per_token.py [--out FILE]

No weights: sizes follow from shapes and types. Q4_K_M's types are llama.cpp's choice for it
(llama-quant.cpp): attn_v and ffn_down Q6_K in layers i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2
(8 of 16), Q4_K elsewhere; the tied token_embd Q6_K (as an output tensor). Q4_0 and Q8_0 files
are taken as pure (every matrix in the type; llama.cpp's default Q4_0 file keeps its output
tensor in Q6_K, noted in the output)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvflow.model.quant.packing import packed_bytes  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 16, 32, 8, 64, 128256
# GGUF bytes per weight
GGUF_BYTES = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q4_K": 144 / 256, "Q6_K": 210 / 256}
# kvflow's kind per GGUF type, before and now (gguf_blocks.decode); a fused weight whose parts
# differ took q4 where all were 4-bit, else q8; now each part keeps its kind
# (gguf_native._quantized: every shape here fills whole panels)
KIND_NOW = {"Q8_0": "q8", "Q4_0": "q4s", "Q4_1": "q4", "Q4_K": "q4k", "Q6_K": "q6"}
KIND_BEFORE = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q6_K": "q8"}
BEFORE_RECORD = {"q4": 320, "q8": 608}  # per 16 outputs x 32 inputs


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def projections(ftype: str) -> list[tuple[str, list[tuple[int, str]], int]]:
    """(name, [(rows, GGUF type) of each fused part], K) of every weight a decode step reads."""
    def t(base: str, more: bool) -> str:
        if ftype == "Q4_K_M":
            return "Q6_K" if more else "Q4_K"
        return ftype

    out = []
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        more = use_more_bits(i, LAYERS)
        out.append((f"{i}.qkv", [(q, t("q", False)), (kv, t("k", False)), (kv, t("v", more))], HIDDEN))
        out.append((f"{i}.o", [(HIDDEN, t("o", False))], q))
        out.append((f"{i}.gate_up", [(FFN, t("gate", False)), (FFN, t("up", False))], HIDDEN))
        out.append((f"{i}.down", [(HIDDEN, t("down", more))], FFN))
    out.append(("lm_head", [(VOCAB, "Q6_K" if ftype == "Q4_K_M" else ftype)], HIDDEN))
    return out


def kind_of(types: list[str], table: dict[str, str]) -> str:
    kinds = {table[x] for x in types}
    if len(kinds) == 1:
        return kinds.pop()
    return "q4" if kinds <= {"q4", "q4s", "q4k"} else "q8"


def bytes_per_token(ftype: str) -> dict[str, float]:
    gguf = before = now = 0.0
    for _, parts, k in projections(ftype):
        n = sum(r for r, _ in parts)
        gguf += sum(r * k * GGUF_BYTES[x] for r, x in parts)
        kb = kind_of([x for _, x in parts], KIND_BEFORE)
        before += -(-n // 16) * (k // 32) * BEFORE_RECORD[kb]
        if len({KIND_NOW[x] for _, x in parts}) > 1:  # each part in its own kind (pack_parts)
            now += sum(packed_bytes(KIND_NOW[x], r, k) for r, x in parts)
        else:
            now += packed_bytes(KIND_NOW[parts[0][1]], n, k)
    return {"gguf_MB": round(gguf / 1e6, 1), "before_MB": round(before / 1e6, 1),
            "now_MB": round(now / 1e6, 1), "now_over_gguf": round(now / gguf, 3),
            "before_over_now": round(before / now, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for ftype in ("Q4_K_M", "Q4_0", "Q8_0"):
        r = bytes_per_token(ftype)
        rows.append([ftype, r["gguf_MB"], r["before_MB"], r["now_MB"], r["now_over_gguf"], r["before_over_now"]])
        print(f"{ftype:7} GGUF {r['gguf_MB']:7.1f} MB | kvflow before {r['before_MB']:7.1f} MB | now "
              f"{r['now_MB']:7.1f} MB ({r['now_over_gguf']}x the file's, {r['before_over_now']}x fewer than before)")
    if a.out:
        result = {"schema": "kvflow-bench/1", "kind": "table",
                  "title": "weight bytes read per batch-1 decode token, Llama-3.2-1B shape",
                  "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                  "command": "python benchmarks/quant_bytes_per_token.py", "notes": [__doc__],
                  "columns": ["file type", "gguf_MB", "kvflow_before_MB", "kvflow_now_MB",
                              "now_over_gguf", "before_over_now"], "rows": rows}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
