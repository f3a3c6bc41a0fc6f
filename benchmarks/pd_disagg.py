"""Prefill/decode disaggregation against plain replicas, behind the same `kvflow router`.

    .venv/bin/python benchmarks/pd_disagg.py [--rounds 2] [--duration 30] [--short-rate 2]
        [--long-every 10] [--long-len 2000] [--save-json out.json]
    .venv/bin/python benchmarks/pd_disagg.py --transfer-only

The workload: short requests (64-token prompts, 64 output tokens) arriving as a Poisson process
at --short-rate, and among them a long prompt (--long-len tokens, 16 output tokens) every
--long-every seconds; every request streamed. Two set-ups, each two `kvflow serve` instances of
the default model with one compute thread each, started once and measured in alternating rounds:

    pd        router --prefill A --decode B   (A kv_producer, B kv_consumer)
    replicas  router --replicas C D           (plain instances)

Reported per set-up (medians over rounds): the short requests' TTFT and ITL p50 / p99, and the
long requests' TTFT. For `pd`, each request's TTFT is also broken down: the prefill hop (the
router's `x-kvflow-prefill-ms` header: from sending the request to the prefill instance to its
kv_transfer_params coming back, its queue included) and the pull (the decode instance's trace:
from asking for the blocks to the last byte arriving), p50 / p99 for short and long requests.
Every instance writes a step trace (to a temporary folder), so that both set-ups pay the same. A long prompt's chunks stall every decode that shares its instance's step
(ITL p99 of the replicas); disaggregated, decodes never share a step with a long prefill, at the
price of every prompt waiting behind the one prefill instance (TTFT).

--transfer-only (also run after the rounds): the KV bytes/s of one 2,000-token pull of the
default model's layout between two agents in one process, over loopback ZeroMQ and over shared
memory, alternated (medians of 9 each).
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvflow.entrypoints.bench_serve import stream_one  # noqa: E402
from kvflow.entrypoints.router import PREFILL_HEADER  # noqa: E402
from kvflow.utils.cpuinfo import read_cpuinfo  # noqa: E402

# each request's task holds a dict that the response hook fills with the router's prefill time
_reply = contextvars.ContextVar("reply")


async def _note_prefill(resp: httpx.Response) -> None:
    ms = resp.headers.get(PREFILL_HEADER)
    if ms is not None:
        _reply.get()["prefill_ms"] = float(ms)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    return read_cpuinfo().model_name


class Proc:
    def __init__(self, args: list[str], url: str, env=None) -> None:
        self.url = url
        self.proc = subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", *args],
                                     cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def serve(extra: list[str], env, trace: str) -> Proc:
    port = free_port()
    return Proc(["serve", "--port", str(port), "--num-threads", "1", "--num-blocks", "640",
                 "--max-model-len", "4096", "--trace", trace, *extra],
                f"http://127.0.0.1:{port}", env)


def router(args: list[str]) -> Proc:
    port = free_port()
    return Proc(["router", "--port", str(port), *args], f"http://127.0.0.1:{port}")


def workload(args, seed: int) -> list[tuple[float, list[int], int, bool]]:
    """(arrival s, prompt ids, max_tokens, is_long), sorted by arrival."""
    rng = random.Random(seed)
    items, t = [], 0.0
    while True:
        t += rng.expovariate(args.short_rate)
        if t >= args.duration:
            break
        items.append((t, [rng.randrange(100, 49000) for _ in range(64)], 64, False))
    t = args.long_every / 2
    while t < args.duration:
        items.append((t, [rng.randrange(100, 49000) for _ in range(args.long_len)], 16, True))
        t += args.long_every
    return sorted(items, key=lambda x: x[0])


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


async def run_round(url: str, items) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=512),
                                 event_hooks={"response": [_note_prefill]}) as http:
        start = time.perf_counter()

        async def one(at, prompt, max_tokens, is_long):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            reply = {}
            _reply.set(reply)  # this task's own: the hook runs inside it
            payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}
            res = await stream_one(http, url + "/v1/completions", payload)
            return is_long, res, reply.get("prefill_ms")

        results = await asyncio.gather(*(one(*it) for it in items))
        wall = time.perf_counter() - start
    prefill = {kind: [ms for is_long, r, ms in results if r.ok and ms is not None
                      and is_long == (kind == "long")] for kind in ("short", "long")}
    results = [(is_long, r) for is_long, r, _ in results]
    short = [r for is_long, r in results if not is_long and r.ok]
    long_ = [r for is_long, r in results if is_long and r.ok]
    failed = [r.error for _, r in results if not r.ok]
    itl = np.asarray([x for r in short for x in r.itl]) * 1000
    ttft = np.asarray([r.ttft for r in short]) * 1000
    return {"wall_s": wall, "failed": len(failed), "errors": failed[:3],
            "short_ttft_p50_ms": float(np.percentile(ttft, 50)),
            "short_ttft_p99_ms": float(np.percentile(ttft, 99)),
            "short_itl_p50_ms": float(np.percentile(itl, 50)),
            "short_itl_p99_ms": float(np.percentile(itl, 99)),
            "long_ttft_p50_ms": float(np.median([r.ttft for r in long_]) * 1000) if long_ else None,
            "num_short": len(short), "num_long": len(long_),
            "prefill_short_p50_ms": pct(prefill["short"], 50),
            "prefill_short_p99_ms": pct(prefill["short"], 99),
            "prefill_long_p50_ms": pct(prefill["long"], 50),
            "prefill_long_p99_ms": pct(prefill["long"], 99)}


def read_pulls(trace: str, offset: int) -> tuple[list[dict], int]:
    """The decode instance's finished pulls ("loaded" events) in its trace after `offset`."""
    with open(trace) as f:
        f.seek(offset)
        text = f.read()
    end = offset + len(text.encode())
    return [ev for line in text.splitlines() if line.strip()
            for ev in json.loads(line).get("kv_transfers", []) if ev["event"] == "loaded"], end


def pull_figures(pulls: list[dict], long_len: int) -> dict:
    """Per-pull time and size, short and long prompts apart (a pull's blocks tell which)."""
    out = {}
    for kind in ("short", "long"):
        ps = [p for p in pulls if (p["blocks"] * 16 >= long_len // 2) == (kind == "long")]
        ms = [p["seconds"] * 1e3 for p in ps]
        out |= {f"pull_{kind}_p50_ms": pct(ms, 50), f"pull_{kind}_p99_ms": pct(ms, 99),
                f"pull_{kind}_MB": pct([p["bytes"] / 1e6 for p in ps], 50),
                f"pull_{kind}_shm_share": (sum(p["shm"] for p in ps) / len(ps)) if ps else None,
                f"num_pulls_{kind}": len(ps)}
    return out


def transfer_rates(reps: int = 9) -> dict:
    """Bytes/s of one 2,000-token pull of SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64,
    bf16, blocks of 16) between two agents in this process: ZeroMQ over loopback and shared
    memory, alternated pull by pull so that both see the same load."""
    import torch

    from kvflow.config import KVTransferConfig
    from kvflow.core.scheduler_output import KVLoad
    from kvflow.kv_transfer.agent import KVTransferAgent, write_blocks
    from kvflow.kv_transfer.blocks import KVShard, PagedKV

    nb, bs = 130, 16
    n = 125  # 2,000 tokens

    def caches():
        return [(torch.randn(nb, 3, bs, 64).to(torch.bfloat16),
                 torch.randn(nb, 3, bs, 64).to(torch.bfloat16)) for _ in range(30)]

    pairs, rates = {}, {"zmq_loopback": [], "shm": []}
    try:
        for name in rates:
            src, dst = caches(), caches()
            prod = KVTransferAgent(KVTransferConfig("kv_producer", kv_port=free_port()), {},
                                   PagedKV([KVShard(0, src)]), bs)
            cons = KVTransferAgent(KVTransferConfig("kv_consumer", kv_use_shm=name == "shm"), {},
                                   PagedKV([KVShard(0, dst)]), bs)
            pairs[name] = (prod, cons, src, dst)
        for i in range(reps):
            for name, (prod, cons, src, dst) in pairs.items():
                tid = f"t{i}"
                prod.offer(tid, list(range(n)), n * bs)
                time.sleep(0.05)
                p = prod.params_for(tid, list(range(n)), n * bs)
                t0 = time.perf_counter()
                cons.load(KVLoad("r", p, list(range(n)), list(range(n)), 0, n * bs - 1))
                ev = None
                while ev is None:
                    cons.wait(1.0)
                    ev = next((e for e in cons.drain_events() if e.kind in ("loaded", "failed")),
                              None)
                assert ev.kind == "loaded", ev.error
                assert (len(ev.frames) == 1) == (name == "shm")
                write_blocks(cons.kv, ev)
                cons.release_remote(p, done=True)
                rates[name].append(ev.num_bytes / (time.perf_counter() - t0))
                while not any(e.kind == "released" for e in prod.drain_events()):
                    prod.wait(1.0)
        for prod, cons, src, dst in pairs.values():
            assert all(torch.equal(a[0][:n], b[0][:n]) for a, b in zip(src, dst))
    finally:
        for prod, cons, _, _ in pairs.values():
            prod.shutdown()
            cons.shutdown()
    return {name: {"bytes": n * 30 * 2 * 3 * bs * 64 * 2, "pulls": len(r),
                   "median_GBps": statistics.median(r) / 1e9, "min_GBps": min(r) / 1e9,
                   "max_GBps": max(r) / 1e9} for name, r in rates.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--short-rate", type=float, default=2.0)
    ap.add_argument("--long-every", type=float, default=10.0)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--transfer-only", action="store_true")
    ap.add_argument("--save-json")
    args = ap.parse_args()
    report = {"cpu": cpu_name(), "load_before": os.getloadavg()}
    if not args.transfer_only:
        env = dict(os.environ, KVFLOW_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        kvp = json.dumps({"kv_role": "kv_producer", "kv_port": free_port()})
        kvc = json.dumps({"kv_role": "kv_consumer", "kv_port": free_port()})
        tmp = tempfile.mkdtemp(prefix="kvflow-pd-bench-")
        traces = [os.path.join(tmp, f"{i}.jsonl") for i in range(4)]
        procs = [serve(["--kv-transfer-config", kvp], env, traces[0]),
                 serve(["--kv-transfer-config", kvc], env, traces[1]),
                 serve([], env, traces[2]), serve([], env, traces[3])]
        routers = []
        try:
            for p in procs:
                p.wait_ready()
            routers = [router(["--prefill", procs[0].url, "--decode", procs[1].url]),
                       router(["--replicas", procs[2].url, procs[3].url])]
            for r in routers:
                r.wait_ready()
            setups = {"pd": routers[0].url, "replicas": routers[1].url}
            for url in setups.values():  # warm-up: one of each kind
                asyncio.run(run_round(url, [(0.0, list(range(100, 164)), 8, False),
                                            (0.0, list(range(200, 200 + args.long_len)), 2, True)]))
            rounds = {k: [] for k in setups}
            _, offset = read_pulls(traces[1], 0)  # the warm-up's pulls are not counted
            for i in range(args.rounds):
                items = workload(args, seed=i)
                for name, url in setups.items():
                    res = run_round_sync(url, items)
                    if name == "pd":
                        pulls, offset = read_pulls(traces[1], offset)
                        res |= pull_figures(pulls, args.long_len)
                    rounds[name].append(res)
                    print(f"round {i} {name}: {json.dumps(res)}", flush=True)
            report["rounds"] = rounds
            report["median"] = {
                name: {k: statistics.median(r[k] for r in rs)
                       for k in rs[0] if all(isinstance(r.get(k), float) for r in rs)}
                for name, rs in rounds.items()}
            m = httpx.get(procs[1].url + "/metrics").text
            report["decode_metrics"] = {line.split("{")[0]: float(line.split()[-1])
                                        for line in m.splitlines()
                                        if line.startswith("kvflow:kv_transfer_")
                                        and "_created" not in line}
        finally:
            for p in routers + procs:
                p.stop()
            for t in traces:
                if os.path.exists(t):
                    os.unlink(t)
            os.rmdir(tmp)
    report["transfer"] = transfer_rates()
    report["load_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_round_sync(url, items) -> dict:
    return asyncio.run(run_round(url, items))


if __name__ == "__main__":
    sys.exit(main())
