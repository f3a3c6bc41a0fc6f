"""Prefix caching through `kvflow serve`: N requests sharing a long system prompt, caching on
vs off. Each mode gets its own server subprocess; one warm-up request (same system prompt,
its own suffix) runs first in both modes, then the N requests arrive at once.

    .venv/bin/python benchmarks/prefix_cache.py [--num-requests 64] [--prefix-len 512]
        [--suffix-len 32] [--output-len 32] [--threads 1] [--save-json out.json]

Reports per mode: TTFT p50 / p90, total wall time, prompt tokens computed vs found in the cache
(from /metrics), and the speed-up of caching on over off.

    .venv/bin/python benchmarks/prefix_cache.py --hash-cost [--prefix-len 2048]

only times the block hashes of one prompt (sha256 per full block, as admission computes them)
against Python's hash() of the same tuples, which they replaced.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start_server(args, caching: bool) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-bench-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--port", str(port),
           "--max-model-len", "1024", "--num-threads", str(args.threads),
           "--kv-cache-memory", args.kv_cache_memory,
           "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{open(log.name).read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready")


async def one(http: httpx.AsyncClient, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, end) in seconds after the request was sent."""
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


def run_mode(args, caching: bool) -> dict:
    rng = random.Random(args.seed)
    vocab_lo, vocab_hi = 1000, 40000  # ordinary tokens, no specials
    system = [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.suffix_len)]
               for _ in range(args.num_requests + 1)]
    proc, url, log = start_server(args, caching)
    try:
        async def run() -> tuple[list[tuple[float, float]], float]:
            limits = httpx.Limits(max_connections=args.num_requests + 4)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
                await one(http, prompts[0], args.output_len)  # warm-up: fills the cache if on
                t0 = time.perf_counter()
                res = await asyncio.gather(*(one(http, p, args.output_len) for p in prompts[1:]))
                return res, time.perf_counter() - t0

        q0, h0 = (metric(url, "kvflow:prefix_cache_queries_total"),
                  metric(url, "kvflow:prefix_cache_hits_total"))
        results, wall = asyncio.run(run())
        queries = metric(url, "kvflow:prefix_cache_queries_total") - q0
        hits = metric(url, "kvflow:prefix_cache_hits_total") - h0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
        os.unlink(log.name)
    ttfts = sorted(r[0] for r in results)
    n_prompt = (args.num_requests + 1) * (args.prefix_len + args.suffix_len)
    return {"prefix_caching": caching, "num_requests": args.num_requests,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
            "total_s": wall, "prompt_tokens": n_prompt,
            "prompt_tokens_from_cache": int(hits) if caching else 0,
            "prompt_tokens_computed": n_prompt - (int(hits) if caching else 0),
            "prefix_cache_queries": int(queries)}


def hash_cost(prompt_len: int, block_size: int = 16, repeats: int = 200) -> None:
    """Median time to hash every full block of one `prompt_len`-token prompt."""
    import statistics

    from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
    from kvflow.core.kv_cache.spec import FullAttentionSpec
    from kvflow.request import Request

    rng = random.Random(0)
    tokens = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
    num_blocks = prompt_len // block_size
    kv = KVCacheCoordinator([FullAttentionSpec()], num_blocks=num_blocks + 1, block_size=block_size)

    def sha() -> None:
        kv.req_to_hashes.clear()
        kv._block_hashes(Request("r", tokens, cache_salt="tenant"), num_blocks)

    def builtin() -> None:
        parent = None
        for i in range(num_blocks):
            parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), "tenant"))

    for name, fn in (("sha256 (now)", sha), ("hash() (before)", builtin)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:16s} {num_blocks} blocks of a {prompt_len}-token prompt: "
              f"{statistics.median(times) * 1e6:7.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-json", default=None)
    p.add_argument("--hash-cost", action="store_true", help="only time the block hashes")
    args = p.parse_args()
    if args.hash_cost:
        return hash_cost(args.prefix_len)
    off = run_mode(args, caching=False)
    on = run_mode(args, caching=True)
    summary = {"off": off, "on": on,
               "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
               "total_speedup": off["total_s"] / on["total_s"],
               "prefill_work_ratio": off["prompt_tokens_computed"] / on["prompt_tokens_computed"]}
    for r in (off, on):
        print(f"prefix caching {'on ' if r['prefix_caching'] else 'off'}: TTFT p50 "
              f"{r['ttft_p50_s'] * 1000:8.0f} ms  p90 {r['ttft_p90_s'] * 1000:8.0f} ms  total "
              f"{r['total_s']:6.1f} s  prompt tokens computed {r['prompt_tokens_computed']:6d} "
              f"(from cache {r['prompt_tokens_from_cache']})")
    print(f"speed-up with caching: TTFT p50 {summary['ttft_p50_speedup']:.1f}x, total "
          f"{summary['total_speedup']:.1f}x, prefill work {summary['prefill_work_ratio']:.1f}x less")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
