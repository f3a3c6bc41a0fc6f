"""Chart of W1 throughput, kvflow against its peers, per CPU kind, from the results files.

    python benchmarks/plot_results.py [--out docs/performance_w1.png]

One panel per CPU kind with a complete `compare.py` run (the newest, as in the tables of
docs/performance.md): W1 output tokens/s of each engine on one compute thread and on the whole
machine (two threads), labelled with the CPU, the dtype, the commit and the date."""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import results_io  # noqa: E402


SHORT = {"kvflow": "kvflow", "vllm": "vLLM CPU\n0.32.0", "llamacpp": "llama.cpp\n(0.3.36)",
         "hf-static": "HF generate\n(static, 16)", "hf-batch": "HF\ngenerate_batch"}


def plot(out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results_io.latest_per_kind(results_io.load_all()).values() if r]
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(6.2 * max(1, len(runs)), 4.4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        engines = list(dict.fromkeys(r["engine"] for r in run["w1"]))
        vals = {(r["engine"], r["threads"]): r["output_tok_s"] for r in run["w1"]}
        width = 0.38
        for i, (threads, label) in enumerate(((1, "1 thread"), (2, "2 threads"))):
            xs = [j + (i - 0.5) * width for j in range(len(engines))]
            ys = [vals.get((e, threads), 0) for e in engines]
            bars = ax.bar(xs, ys, width, label=label, color=("#4c72b0", "#dd8452")[i])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(engines)))
        ax.set_xticklabels([SHORT.get(e, e) for e in engines], fontsize=8)
        ax.set_ylabel("W1 output tokens/s")
        kind = results_io.CPU_KINDS[run["cpu"]["kind"]]
        ax.set_title(f"{kind}\n{run['dtype']}, commit {run['commit']}, {run['date'][:10]}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("W1: 128 prompts U[32, 512] tokens, 128 greedy output tokens, same weights for every engine",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": None})
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "performance_w1.png"))
    print(plot(p.parse_args().out))
