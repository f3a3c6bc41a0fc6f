"""`kvflow router --policy cache_aware` against `--policy round_robin` on a multi-turn chat.

Two `kvflow serve` replicas of the default model (one compute thread each) and two routers in
front of the same replicas, one per policy. A round is S chat sessions run at once, each T
turns long: every session starts with the same system prompt, and each turn sends the whole
conversation so far (system, then user / assistant turns, the replies as the model gave them)
plus a new user message. Rounds alternate between the routers (`--variant`, the last one the
baseline of the ratios); before each, both replicas'
prefix caches are reset and every round's user messages are new, so that no round inherits
another's cache (the system prompt is re-learnt every round).

Per policy it reports the prefix-cache hit rate (prompt tokens found in the replicas' caches
over those looked up, from their /metrics), TTFT p50 / p99 (client-side, streamed), completion
tokens per second over the round's wall time, and where the requests went; medians over the
rounds of each policy, and the ratios.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/router_cache_aware.py \\
        [--sessions 8] [--turns 5] [--rounds 3] [--output-len 24] [--save-json PATH]

With `--kv-events` the replicas publish their KV events, and a variant's flags may name
`{events}`, their endpoints in order: `--variant 'events=--policy cache_aware
--kv-events-endpoints {events}'` routes by the blocks the replicas report rather than by the
text tree (compare under cache pressure, a small `--kv-cache-memory`, where they evict).
"""
from __future__ import annotations

import argparse
import asyncio
from results_io import cpu_name  # beside this script
import datetime
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("river stone light garden window paper music winter orange market bridge cloud "
         "engine letter forest silver candle harbor pencil summer valley yellow mirror "
         "thunder basket island rocket meadow lantern shadow").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def wait_ready(proc: subprocess.Popen, url: str, path: str, log: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready")


def start(cmd: list[str], path: str) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", *cmd, "--port",
                             str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    return proc, f"http://127.0.0.1:{port}", log.name


def replica_counts(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("kvflow:prefix_cache_queries_total"), total("kvflow:prefix_cache_hits_total")


def routed(router: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(router + "/metrics", timeout=30).text
    for url, v in re.findall(r'^kvflow_router:backend_requests_total\{backend="([^"]+)"[^}]*\} (\S+)$',
                             text, re.M):
        out[url] = out.get(url, 0.0) + float(v)
    return out


def reasons(router: str) -> dict[str, float]:
    """Requests routed so far by why (cache_hit, balance, kv_cache_hit, ...)."""
    out: dict[str, float] = {}
    text = httpx.get(router + "/metrics", timeout=30).text
    for why, v in re.findall(r'^kvflow_router:backend_requests_total\{[^}]*reason="([^"]+)"'
                             r'[^}]*\} (\S+)$', text, re.M):
        out[why] = out.get(why, 0.0) + float(v)
    return out


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


async def turn(http: httpx.AsyncClient, router: str, messages: list[dict], output_len: int
               ) -> tuple[float, str, int]:
    """(TTFT s, the reply's text, completion tokens) of one streamed chat request."""
    body = {"messages": messages, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, tokens = None, [], 0
    async with http.stream("POST", router + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", ()):
                text = c.get("delta", {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(parts), tokens


async def session(http, router: str, system: str, rng: random.Random, args) -> list[tuple]:
    messages = [{"role": "system", "content": system}]
    out = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": sentence(rng, args.user_words)})
        ttft, reply, tokens = await turn(http, router, messages, args.output_len)
        messages.append({"role": "assistant", "content": reply})
        out.append((ttft, tokens))
    return out


def reset_caches(replicas: list[str]) -> None:
    for url in replicas:
        deadline = time.monotonic() + 60
        while httpx.post(url + "/reset_prefix_cache", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, f"{url} never idle"
            time.sleep(0.2)


def run_round(policy: str, router: str, replicas: list[str], system: str, seed: int, args) -> dict:
    reset_caches(replicas)
    before = [replica_counts(u) for u in replicas]
    sent_before = routed(router)
    why_before = reasons(router)
    rngs = [random.Random(seed * 1000 + s) for s in range(args.sessions)]

    async def run():
        limits = httpx.Limits(max_connections=args.sessions + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(session(http, router, system, r, args) for r in rngs))
            return res, time.perf_counter() - t0

    results, wall = asyncio.run(run())
    after = [replica_counts(u) for u in replicas]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    sent_after = routed(router)
    ttfts = sorted(t for s in results for t, _ in s)
    tokens = sum(n for s in results for _, n in s)
    share = [sent_after.get(u, 0) - sent_before.get(u, 0) for u in replicas]
    why = {k: v - why_before.get(k, 0) for k, v in reasons(router).items()
           if v - why_before.get(k, 0)}
    return {"policy": policy, "seed": seed, "wall_s": wall, "requests": len(ttfts),
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "prompt_tokens": int(queries), "prompt_tokens_from_cache": int(hits),
            "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
            "completion_tokens_per_s": tokens / wall, "requests_per_replica": share,
            "reasons": why}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="per variant, the variants in turn")
    p.add_argument("--system-words", type=int, default=120)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS",
                   help="a router to compare, e.g. 'cache_aware=--policy cache_aware' "
                        "(repeatable; default: cache_aware, cache_aware with SGLang's balance "
                        "threshold of 32, and round_robin)")
    p.add_argument("--kv-events", action="store_true",
                   help="replicas publish KV events; `{events}` in a variant's flags names them")
    p.add_argument("--save-json", default=os.path.join(REPO, "benchmarks", "results",
                                                       "router_cache_aware.json"))
    args = p.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant or
                    ("cache_aware=--policy cache_aware",
                     "cache_aware_abs32=--policy cache_aware --balance-abs-threshold 32",
                     "round_robin=--policy round_robin"))

    procs = []
    try:
        replicas = []
        events = []
        for _ in range(args.replicas):
            extra = []
            if args.kv_events:
                port = free_port()
                events.append(f"tcp://127.0.0.1:{port}")
                extra = ["--kv-events-config", json.dumps(
                    {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})]
            proc, url, log = start(["serve", "--num-threads", "1", "--max-model-len", "2048",
                                    "--kv-cache-memory", args.kv_cache_memory, *extra], "/health")
            procs.append((proc, log))
            replicas.append((proc, url, log))
        for proc, url, log in replicas:
            wait_ready(proc, url, "/health", log)
        urls = [u for _, u, _ in replicas]
        routers = {}
        for name, flags in variants.items():
            flags = flags.replace("{events}", " ".join(events))
            proc, url, log = start(["router", "--replicas", *urls, *flags.split()], "/health")
            procs.append((proc, log))
            wait_ready(proc, url, "/list_workers", log)
            routers[name] = url
        system = "You are a helpful assistant. Keep these notes in mind: " + " ".join(
            sentence(random.Random(7 + i), 20) for i in range(args.system_words // 20))
        rounds = []
        names = list(variants)
        for k in range(args.rounds * len(names)):
            policy = names[k % len(names)]
            r = run_round(policy, routers[policy], urls, system, seed=k, args=args)
            rounds.append(r)
            print(f"round {k} {policy:12s} hit rate {r['prefix_hit_rate']:.3f}  TTFT p50 "
                  f"{r['ttft_p50_s'] * 1e3:7.0f} ms  p99 {r['ttft_p99_s'] * 1e3:7.0f} ms  "
                  f"{r['completion_tokens_per_s']:6.1f} tok/s  wall {r['wall_s']:6.1f} s  "
                  f"per replica {r['requests_per_replica']}  {r['reasons']}", flush=True)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            os.unlink(log)

    def med(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds if r["policy"] == policy)

    keys = ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "completion_tokens_per_s", "wall_s")
    summary = {pol: {k: med(pol, k) for k in keys} for pol in variants}
    base = names[-1]  # the last variant is the baseline of the ratios
    rr = summary[base]
    report = {
        "benchmark": "router_cache_aware", "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "note": "shared machine (other jobs ran on the same cores); medians over rounds",
        "setup": {"replicas": args.replicas, "threads_per_replica": 1,
                  "sessions": args.sessions, "turns": args.turns, "rounds": args.rounds,
                  "system_words": args.system_words, "user_words": args.user_words,
                  "output_len": args.output_len, "variants": variants,
                  "kv_cache_memory_per_replica": args.kv_cache_memory,
                  "kv_events": args.kv_events,
                  "model": "SmolLM2-135M-Instruct Q4_1 (default)"},
        "median": summary,
        f"ratio_over_{base}": {name: {
            "ttft_p50": v["ttft_p50_s"] / rr["ttft_p50_s"],
            "ttft_p99": v["ttft_p99_s"] / rr["ttft_p99_s"],
            "throughput": v["completion_tokens_per_s"] / rr["completion_tokens_per_s"]}
            for name, v in summary.items() if name != base},
        "rounds": rounds,
    }
    print(json.dumps({k: report[k] for k in ("cpu", "median", f"ratio_over_{base}")}, indent=2))
    if args.save_json:
        os.makedirs(os.path.dirname(args.save_json), exist_ok=True)
        with open(args.save_json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
