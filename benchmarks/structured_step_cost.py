"""What constrained decoding adds to an engine step: a batch of requests, half of them
constrained by the JSON schemas of structured_backends.py, against the same batch with no
constraint; the mask fill (one batch call) and the mask's application are timed inside the
step.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_step_cost.py [--num-prompts 64]

Prints the decode-step time of both runs (median over the steps where the whole batch
decodes), the fill and apply times per step (p50 / p99) and per constrained token, and the
compile time each constraint waited for (first use; the compile cache serves repeats)."""
from __future__ import annotations

import argparse
import statistics
import time

from structured_backends import SCHEMAS, pct

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured import backends, manager as manager_mod, validate_structured_outputs
from kvflow.worker import model_runner as runner_mod


class Timer:
    def __init__(self) -> None:
        self.times: list[float] = []

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.times.append(time.perf_counter() - t0)
        return timed


def run(llm: LLM, prompts: list[str], params: list[SamplingParams], batch: int) -> list[float]:
    """Decode-step times of one generate (steps where `batch` requests decode, nothing else)."""
    core = llm.engine.core
    steps: list[float] = []
    step = core.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        s = out.scheduler_stats
        if s is not None and s.num_generation_tokens == batch and s.num_prompt_tokens == 0:
            steps.append(time.perf_counter() - t0)
        return out

    core.step = timed_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step = step
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--verbose", action="store_true", help="print every step's fill time")
    args = ap.parse_args()
    n = args.num_prompts
    llm = LLM(dtype=args.dtype, structured_outputs_backend=args.backend, max_num_seqs=n)
    fill, wait, apply = Timer(), Timer(), Timer()
    for cls in (backends.LLGuidanceBackend, backends.XGrammarBackend):  # in the fill thread
        cls.fill_bitmask = fill.wrap(cls.fill_bitmask)
    # what the step itself waits for the fill, which runs beside the forward
    real_wait = manager_mod.GrammarBitmask.wait
    timed_wait = wait.wrap(real_wait)
    manager_mod.GrammarBitmask.wait = lambda self: (timed_wait if self._fill is not None
                                                    else real_wait)(self)
    runner_mod.apply_grammar_bitmask = apply.wrap(runner_mod.apply_grammar_bitmask)

    schemas = []  # those the backend enforces in full (llguidance refuses uniqueItems)
    for schema, _ in SCHEMAS:
        try:
            validate_structured_outputs(StructuredOutputsParams(json=schema), args.backend)
            schemas.append(schema)
        except ValueError:
            pass
    prompts = [f"Fill in record {i} as JSON matching the schema:" for i in range(n)]
    # ignore_eos and a token budget every schema reaches: every request decodes max_tokens
    # steps (a constrained one stops when its grammar completes)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(
                                      json=schemas[i // 2 % len(schemas)]))
                   if i % 2 == 0 else plain for i in range(n)]
    run(llm, prompts[:4], [plain] * 4, 4)  # warm-up
    # the compile cache warmed too: the timed run then admits every request at once
    run(llm, prompts[:len(schemas) * 2], [SamplingParams(max_tokens=1, **{
        "structured_outputs": p.structured_outputs}) for p in constrained[:len(schemas) * 2]], 0)
    fill.times.clear()
    wait.times.clear()
    apply.times.clear()
    base = run(llm, prompts, [plain] * n, n)
    t0 = time.perf_counter()
    mixed = run(llm, prompts, constrained, n)
    mixed_wall = time.perf_counter() - t0
    fill_ms = [t * 1e3 for t in fill.times]
    apply_ms = [t * 1e3 for t in apply.times]
    wait_ms = [t * 1e3 for t in wait.times]
    rows = n // 2
    print(f"{n} requests ({rows} constrained, {len(schemas)} schemas round-robin), "
          f"{args.dtype}, backend {manager_mod.resolve_backend(args.backend)}, "
          f"max_tokens {args.max_tokens}")
    print(f"decode step at batch {n}: unconstrained p50 {statistics.median(base) * 1e3:.1f} ms "
          f"({len(base)} steps); half constrained p50 "
          f"{statistics.median(mixed) * 1e3:.1f} ms ({len(mixed)} steps; the constrained ones "
          f"finish early, so later steps are smaller)")
    print(f"mask fill per step: p50 {statistics.median(fill_ms):.2f} ms, p99 "
          f"{pct(fill_ms, 0.99):.2f} ms ({len(fill_ms)} steps); apply p50 "
          f"{statistics.median(apply_ms):.2f} ms, p99 {pct(apply_ms, 0.99):.2f} ms; "
          f"at {rows} rows: {statistics.median(fill_ms) / rows * 1e3:.1f} + "
          f"{statistics.median(apply_ms) / rows * 1e3:.1f} us per constrained token")
    print(f"the step's wait for the fill (it runs beside the forward): p50 "
          f"{statistics.median(wait_ms):.3f} ms, p99 {pct(wait_ms, 0.99):.3f} ms")
    print(f"half-constrained generate: {mixed_wall:.1f} s wall")
    if args.verbose:
        print("fill ms per step:", " ".join(f"{t:.2f}" for t in fill_ms))
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
