"""Structured outputs' cost on the batched path: a W1-style batch of 64 chat requests
asking for JSON, run twice on one engine, alternating: all unconstrained, then the same batch with
half of it constrained by the suite's JSON schemas (tests/structured_schemas.py). Both runs
generate `--output-len` tokens per request (ignore_eos; a constrained request's schema is "a
list of exactly N <suite objects>", long enough that its grammar rarely ends first), and the
comparison is made on the engine's own trace: the step time of the decode steps in which all 64
requests ran. Also: the bitmask fill per step and per constrained token (p50/p99; the backend's
fill_bitmask, which the engine runs in a thread beside the forward), the logits masking and the
matchers' accept, and each suite schema's compile time (p50/p99, cache cleared).

    PYTHONPATH=. .venv/bin/python benchmarks/structured_outputs.py [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def make_batch(n: int, items: int):
    """n chat prompts asking for JSON (the suite's, cycled, each asking for `items` of them) and
    the long schema of each: an array of exactly `items` instances of the suite's schema."""
    from structured_schemas import SCHEMAS

    convs, schemas = [], []
    for i in range(n):
        s = SCHEMAS[i % len(SCHEMAS)]
        convs.append([{"role": "user", "content": f"Request {i}. Give {items} examples, as a JSON "
                                                  f"array. Each: {s['prompt']}"}])
        schemas.append({"type": "array", "items": s["schema"], "minItems": items, "maxItems": items})
    return convs, schemas


def full_batch_step_times(trace_path: str, offset: int, n: int) -> list[float]:
    """Step times of the decode steps, recorded after `offset`, in which all n requests ran."""
    times = []
    with open(trace_path, encoding="utf-8") as f:
        f.seek(offset)
        for line in f:
            rec = json.loads(line)
            reqs = rec.get("requests", [])
            if len(reqs) == n and all(r["phase"] == "decode" for r in reqs):
                times.append(rec["step_time"])
    return times


class Timer:
    """Wraps obj.name so that each call's duration is appended to self.times."""

    def __init__(self, obj, name: str) -> None:
        self.times: list[float] = []
        self.obj, self.name, self.fn = obj, name, getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self.fn(*a, **kw)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(obj, name, timed)

    def restore(self) -> None:
        setattr(self.obj, self.name, self.fn)


def compile_times(llm, schemas: list[dict]) -> tuple[list[float], list[float]]:
    """Per schema, cold (no cache): the engine backend's compile and matcher, the time a request
    waits in waiting_for_grammar; and that plus the matcher's first mask fill (llguidance builds
    its lexer lazily, on the first mask)."""
    import numpy as np

    from kvflow.sampling_params import StructuredOutputsParams

    manager = llm.engine.core.structured
    backend = manager._get_backend()
    words = (manager.vocab_size + 31) // 32
    build, first = [], []
    for schema in schemas:
        t0 = time.perf_counter()
        matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=schema)))
        t1 = time.perf_counter()
        backend.fill_bitmask([matcher], np.zeros((1, words), dtype=np.int32))
        build.append(t1 - t0)
        first.append(time.perf_counter() - t0)
    return build, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--items", type=int, default=6, help="instances per constrained answer")
    p.add_argument("--repeats", type=int, default=5, help="alternating pairs of runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto", help="structured_outputs_backend")
    args = p.parse_args()

    from kvflow import LLM, SamplingParams
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured import StructuredOutputRequest
    from kvflow.worker import model_runner as runner_module
    from structured_schemas import SCHEMAS

    trace = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    llm = LLM(dtype="float32", max_model_len=1024, num_threads=args.threads, trace=trace,
              structured_outputs_backend=args.backend)
    convs, schemas = make_batch(args.num_prompts, args.items)
    free = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    mixed = [SamplingParams(max_tokens=args.output_len, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
             if i % 2 else free for i, schema in enumerate(schemas)]
    n_cons = sum(p.structured_outputs is not None for p in mixed)

    # warm the compile cache, so that no measured request waits for its grammar
    llm.chat(convs, [replace(p, max_tokens=1) for p in mixed], use_tqdm=False)
    build_s, first_s = compile_times(llm, [s["schema"] for s in SCHEMAS])

    runs = {"unconstrained": [], "half constrained": []}
    fill_s, apply_s, accept_s, lengths_cons, n_steps = [], [], [], [], 0
    for _ in range(args.repeats):
        for label, params in (("unconstrained", free), ("half constrained", mixed)):
            offset = os.path.getsize(trace)
            # the batch fill itself (it runs in a thread beside the forward), not its submission
            timers = [Timer(llm.engine.core.structured._get_backend(), "fill_bitmask"),
                      Timer(runner_module, "apply_grammar_bitmask"),
                      Timer(StructuredOutputRequest, "accept")]
            outs = llm.chat(convs, params, use_tqdm=False)
            for t in timers:
                t.restore()
            if label == "unconstrained":
                assert not timers[0].times, "an unconstrained batch filled a mask"
            else:
                fill_s += timers[0].times
                apply_s += timers[1].times
                accept_s += timers[2].times
                lengths_cons += [len(o.outputs[0].token_ids) for o, p in zip(outs, params)
                                 if p.structured_outputs is not None]
            steps = full_batch_step_times(trace, offset, args.num_prompts)
            runs[label].append(statistics.median(steps))
            if label != "unconstrained":
                n_steps += len(timers[0].times)
            print(f"{label}: {len(steps)} full-batch decode steps, median "
                  f"{runs[label][-1] * 1e3:.1f} ms", file=sys.stderr)
    os.unlink(trace)

    base = statistics.median(runs["unconstrained"])
    with_c = statistics.median(runs["half constrained"])
    n_cons_tokens = sum(lengths_cons)
    accounted = (sum(fill_s) + sum(apply_s) + sum(accept_s)) / max(n_steps, 1)
    ms = lambda xs, q: f"{pct(xs, q) * 1e3:.2f}"  # noqa: E731
    rows = [
        (f"step time at batch {args.num_prompts}, unconstrained (ms)", f"{base * 1e3:.1f}",
         " / ".join(f"{x * 1e3:.1f}" for x in runs["unconstrained"])),
        (f"step time at batch {args.num_prompts}, half constrained (ms)", f"{with_c * 1e3:.1f}",
         " / ".join(f"{x * 1e3:.1f}" for x in runs["half constrained"])),
        ("extra step time (medians; least-disturbed runs)",
         f"{(with_c / base - 1) * 100:+.1f}%",
         f"{(min(runs['half constrained']) / min(runs['unconstrained']) - 1) * 100:+.1f}%; "
         "target <= +10%"),
        ("fill + apply + accept per step, if serial (ms)", f"{accounted * 1e3:.2f}",
         f"{accounted / min(runs['unconstrained']) * 100:+.1f}% of the least-disturbed step; "
         "the fill runs beside the forward"),
        ("mask fill per step, p50 / p99 (ms)", f"{ms(fill_s, 50)} / {ms(fill_s, 99)}",
         f"{len(fill_s)} steps, {n_cons} constrained rows, one batch call"),
        ("mask applied to logits per step, p50 / p99 (ms)", f"{ms(apply_s, 50)} / {ms(apply_s, 99)}", ""),
        ("mask fill per constrained token, p50 / p99 (us)",
         f"{pct(fill_s, 50) / n_cons * 1e6:.1f} / {pct(fill_s, 99) / n_cons * 1e6:.1f}",
         f"a step's fill / {n_cons} rows"),
        ("matcher accept per token, p50 / p99 (us)",
         f"{pct(accept_s, 50) * 1e6:.1f} / {pct(accept_s, 99) * 1e6:.1f}", f"{len(accept_s)} tokens"),
        ("compile per schema, p50 / p99 (ms)", f"{ms(build_s, 50)} / {ms(build_s, 99)}",
         f"{len(build_s)} suite schemas, cold; max {max(build_s) * 1e3:.2f}"),
        ("compile + first mask, p50 / p99 (ms)", f"{ms(first_s, 50)} / {ms(first_s, 99)}",
         f"max {max(first_s) * 1e3:.2f}"),
        ("constrained answers (tokens)", f"{statistics.median(lengths_cons):.0f}",
         f"min {min(lengths_cons)}, max {max(lengths_cons)}; {n_cons_tokens} in all"),
    ]
    width = max(len(r[0]) for r in rows)
    core = llm.engine.core
    print(f"backend {core.structured.backend_name}, {args.num_prompts} requests x {args.output_len} "
          f"tokens, threads {args.threads}, {args.repeats} alternating pairs")
    print(f"{'':{width}}  {'median':>14}  runs / notes")
    for name, value, note in rows:
        print(f"{name:{width}}  {value:>14}  {note}")


if __name__ == "__main__":
    main()
