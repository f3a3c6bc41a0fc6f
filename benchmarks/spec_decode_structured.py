"""Speculative decoding (n-gram) on constrained requests: 8 prompts asking the default model to
write a person given in the prompt as JSON under a schema, greedy, up to 64 tokens each, one
batch; speculation off and on, each in its own LLM in the same process, alternating round by
round (medians). Prints whether both gave the same tokens, the batch's wall time, and the
acceptance. The default weights are quantized and compute in bfloat16, where a verify step's
shape may change a near-tie (docs/speculative_decoding.md); `--float32` loads float weights
and computes in float32, where greedy outputs must be equal.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/spec_decode_structured.py --float32
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvflow import LLM
from kvflow.model_path import default_model_path
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
          "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"]}
PEOPLE = [("Alice Smith", 31, "Paris"), ("Bob Jones", 45, "Berlin"), ("Carol White", 27, "Rome"),
          ("Dan Brown", 52, "Madrid"), ("Eve Black", 38, "Oslo"), ("Frank Green", 61, "Vienna"),
          ("Grace Hall", 24, "Dublin"), ("Henry King", 49, "Lisbon")]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--float32", action="store_true")
    args = ap.parse_args()
    kw = {"dtype": "float32", "quantization": "none"} if args.float32 else {}
    prompts = [f'Example: {{"name": "Zed Zane", "age": 40, "city": "Bern"}}\n'
               f'Person: {n}, {a} years old, lives in {c}.\nJSON: ' for n, a, c in PEOPLE]
    params = SamplingParams(max_tokens=64, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    llms = {name: LLM(default_model_path(), warmup=False, speculative_config=spec, **kw)
            for name, spec in (("off", None), ("on", SPEC))}
    for llm in llms.values():
        llm.generate(prompts[:1], params, use_tqdm=False)  # grammar compiled, caches warm
    times: dict[str, list[float]] = {"off": [], "on": []}
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
    stats = llms["on"].engine.core.scheduler.spec_stats
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"same tokens: {tokens['off'] == tokens['on']}; output tokens "
          f"{sum(map(len, tokens['off']))}; rounds (s) "
          f"{ {k: [round(x, 2) for x in v] for k, v in times.items()} }")
    print(f"median batch time off {med['off']:.2f} s, on {med['on']:.2f} s "
          f"({med['off'] / med['on']:.2f}x); drafted {stats.num_draft_tokens}, accepted "
          f"{stats.num_accepted_tokens} ({stats.acceptance_rate:.2f})")


if __name__ == "__main__":
    main()
