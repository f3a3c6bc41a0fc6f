"""`kvflow bench serve`: an online serving benchmark against any OpenAI-compatible server.

Random prompts arrive as a Poisson process at `--request-rate` (inf: all at once), each is
streamed, and the client measures what a user sees: time to first token (TTFT), the gaps
between streamed tokens (ITL), time per output token after the first (TPOT) and end-to-end
latency (E2E). Prompts are random token ids sent as a token-id prompt (exact input lengths;
vLLM and SGLang accept these), or decoded text with `--prompt-format text`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where special tokens usually live.
    return [[rng.randrange(100, vocab_size - 100) for _ in range(input_len)] for _ in range(num)]


async def stream_one(http: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """One streamed completion; latencies from the arrival of SSE chunks that carry text."""
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    chunks = 0
    try:
        async with http.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = msg["error"].get("message", str(msg))
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = last is not None
    if not res.ok:
        res.error = "no tokens streamed"
    return res


def _pcts(values: list[float], name: str) -> dict:
    if not values:
        return {f"{name}_{k}_ms": None for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values) * 1000.0
    return {f"{name}_mean_ms": float(a.mean()), f"{name}_p50_ms": float(np.percentile(a, 50)),
            f"{name}_p90_ms": float(np.percentile(a, 90)), f"{name}_p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], wall: float, rate: float) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    summary = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(good), "failed": len(results) - len(good),
        "duration_s": wall, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(good) / wall, "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
        **_pcts([r.ttft for r in good], "ttft"), **_pcts([x for r in good for x in r.itl], "itl"),
        **_pcts(tpot, "tpot"), **_pcts([r.e2e for r in good], "e2e"),
    }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


async def run_rate(args, model: str, prompts, rate: float) -> dict:
    endpoint = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    url = args.base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def payload(prompt) -> dict:
        common = {"model": model, "max_tokens": args.output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": args.temperature}
        if args.ignore_eos:
            common["ignore_eos"] = True  # vLLM/kvflow extension: fixed output length
        if args.endpoint == "chat":
            return {**common, "messages": [{"role": "user", "content": prompt}]}
        return {**common, "prompt": prompt}

    async def one(http, prompt):
        if sem is None:
            return await stream_one(http, url, payload(prompt))
        async with sem:
            return await stream_one(http, url, payload(prompt))

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits,
                                 headers=headers) as http:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(http, prompt)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return summarize(results, wall, rate)


def _model_name(args) -> str:
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def _prompt_sets(args) -> tuple[list, list[list]]:
    """Warm-up prompts and one fresh set per rate, all different: a server's prefix cache must
    not serve one run (or its warm-up) from an earlier one. The same --seed gives the same sets."""
    n_warm, n_rates = args.warmup, len(args.request_rate)
    if args.prompt_format == "ids" and args.endpoint == "completions":
        vocab, decode = args.vocab_size, None
    else:
        from kvflow.model_path import resolve_model_path
        from kvflow.tokenizer import get_tokenizer

        tok = get_tokenizer(resolve_model_path(args.tokenizer))
        vocab, decode = len(tok), tok.decode
    ids = make_prompts(n_warm * n_rates + args.num_prompts * n_rates, args.input_len, vocab, args.seed)
    prompts = [decode(p) for p in ids] if decode else ids
    warm, runs = prompts[:n_warm * n_rates], prompts[n_warm * n_rates:]
    return ([warm[i * n_warm:(i + 1) * n_warm] for i in range(n_rates)],
            [runs[i * args.num_prompts:(i + 1) * args.num_prompts] for i in range(n_rates)])


def print_table(rows: list[dict]) -> None:
    cols = [("rate", "request_rate", "{}"), ("ok", "completed", "{}"),
            ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_tok_s", "{:.1f}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
            ("TTFT p90", "ttft_p90_ms", "{:.0f}"), ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
            ("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p90", "itl_p90_ms", "{:.1f}"),
            ("ITL p99", "itl_p99_ms", "{:.1f}"), ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
            ("TPOT p99", "tpot_p99_ms", "{:.1f}"), ("E2E p50", "e2e_p50_ms", "{:.0f}"),
            ("E2E p90", "e2e_p90_ms", "{:.0f}"), ("E2E p99", "e2e_p99_ms", "{:.0f}")]
    cells = [[h for h, _, _ in cols]] + [
        [("-" if r.get(k) is None else f.format(r[k])) for _, k, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print("(latencies in ms)")


def cmd_bench_serve(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    model = _model_name(args)
    warmups, prompt_sets = _prompt_sets(args)
    rows = []
    for rate, warm, prompts in zip(args.request_rate, warmups, prompt_sets):
        if warm:
            asyncio.run(run_rate(args, model, warm, math.inf))
        row = asyncio.run(run_rate(args, model, prompts, rate))
        row.update(model=model, base_url=args.base_url, num_prompts=args.num_prompts,
                   input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                   endpoint=args.endpoint)
        rows.append(row)
        if row.get("errors"):
            print(f"rate {row['request_rate']}: {row['failed']} failed, e.g. {row['errors'][0]}")
    print_table(rows)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(rows if len(rows) > 1 else rows[0], f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def register(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second, Poisson arrivals (inf: all at once); several run in "
                        "turn, each with its own fresh prompts")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly --output-len tokens (vLLM/kvflow extension; default on)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="ids: random token ids (exact lengths); text: random tokens decoded")
    p.add_argument("--vocab-size", type=int, default=32000, help="range of random token ids")
    p.add_argument("--tokenizer", default=None, help="for --prompt-format text (default: the default model)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before each measured run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-json", default=None, help="write the results here")
    p.set_defaults(func=cmd_bench_serve)

