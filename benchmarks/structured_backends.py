"""xgrammar against llguidance on this CPU, with the default model's tokenizer: what the engine
would pay for each as its structured-outputs backend.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_backends.py [--batch 64] [--threads 1]

For each backend: the one-off tokenizer set-up; the compile time of each of the schemas below
(a cold compile: a fresh compiler / matcher each time, no cache); and the mask fill of one
decode step for a batch of matchers (the schemas round-robin, each matcher walking its schema's
valid instance token by token): one batch call per step, the time per step and per row. The
JSON grammars are compact (no free whitespace), as the engine compiles them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from kvflow.model_path import default_model_path
from kvflow.tokenizer import get_tokenizer

# (schema, a valid instance): shapes that extraction, function-calling and form-filling send
S = "string"
SCHEMAS: list[tuple[dict, dict]] = [
    ({"type": "object", "properties": {"name": {"type": S}, "age": {"type": "integer"}},
      "required": ["name", "age"]}, {"name": "Ada", "age": 36}),
    ({"type": "object", "properties": {
        "city": {"type": S}, "unit": {"type": S, "enum": ["celsius", "fahrenheit"]}},
      "required": ["city"]}, {"city": "Paris", "unit": "celsius"}),
    ({"type": "object", "properties": {
        "title": {"type": S, "maxLength": 80}, "year": {"type": "integer", "minimum": 1800,
                                                        "maximum": 2100},
        "genres": {"type": "array", "items": {"type": S}, "minItems": 1, "maxItems": 4},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}},
      "required": ["title", "year", "genres"]},
     {"title": "Alien", "year": 1979, "genres": ["horror", "sci-fi"], "rating": 8.5}),
    ({"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"]}, {"sentiment": "positive", "confidence": 0.9}),
    ({"type": "object", "properties": {
        "email": {"type": S, "format": "email"}, "phone": {"type": S, "pattern": r"^\+?[0-9 -]{7,15}$"},
        "zip": {"type": S, "pattern": "^[0-9]{5}$"}}, "required": ["email"]},
     {"email": "ada@example.com", "phone": "+44 20 7946", "zip": "02139"}),
    ({"type": "object", "properties": {
        "street": {"type": S}, "city": {"type": S}, "country": {"type": S, "minLength": 2,
                                                              "maxLength": 2}},
      "required": ["street", "city", "country"], "additionalProperties": False},
     {"street": "1 Main St", "city": "Springfield", "country": "US"}),
    ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"}, "name": {"type": S},
            "address": {"type": "object", "properties": {
                "city": {"type": S}, "geo": {"type": "object", "properties": {
                    "lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}}, "required": ["city"]}},
            "required": ["id", "name"]}}, "required": ["user"]},
     {"user": {"id": 7, "name": "Bo", "address": {"city": "Oslo", "geo": {"lat": 59.9, "lon": 10.7}}}}),
    ({"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": S}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 5},
     [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}]),
    ({"type": "object", "properties": {
        "name": {"type": S}, "arguments": {"type": "object", "properties": {
            "query": {"type": S}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["query"]}}, "required": ["name", "arguments"]},
     {"name": "search", "arguments": {"query": "llm serving", "limit": 5}}),
    ({"type": "object", "properties": {
        "date": {"type": S, "format": "date"}, "time": {"type": S, "format": "time"},
        "attendees": {"type": "array", "items": {"type": S, "format": "email"}}},
      "required": ["date", "attendees"]},
     {"date": "2026-12-01", "time": "10:30:00Z", "attendees": ["a@b.co"]}),
    ({"type": "object", "properties": {
        "result": {"anyOf": [{"type": "integer"}, {"type": S}]}, "ok": {"type": "boolean"}},
      "required": ["result", "ok"]}, {"result": 42, "ok": True}),
    ({"type": "object", "properties": {
        "shape": {"oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
             "required": ["kind", "r"]},
            {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                             "h": {"type": "number"}}, "required": ["kind", "w", "h"]}]}},
      "required": ["shape"]}, {"shape": {"kind": "rect", "w": 2, "h": 3}}),
    ({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": S, "maxLength": 20}, "uniqueItems": True,
                 "maxItems": 8}}, "required": ["tags"]}, {"tags": ["fast", "cpu"]}),
    ({"type": "object", "properties": {
        "invoice_id": {"type": S, "pattern": "^INV-[0-9]{6}$"}, "total": {"type": "number",
                                                                      "exclusiveMinimum": 0},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "desc": {"type": S}, "amount": {"type": "number"}}, "required": ["desc", "amount"]}}},
      "required": ["invoice_id", "total", "currency", "lines"]},
     {"invoice_id": "INV-000123", "total": 99.5, "currency": "EUR",
      "lines": [{"desc": "widget", "amount": 99.5}]}),
    ({"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": S}},
      "required": ["answer"]}, {"answer": False, "reason": "no"}),
    ({"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "explanation": {"type": S}, "output": {"type": S}},
            "required": ["explanation", "output"]}},
        "final_answer": {"type": S}}, "required": ["steps", "final_answer"]},
     {"steps": [{"explanation": "add", "output": "2"}], "final_answer": "2"}),
    ({"type": "object", "properties": {
        "entities": {"type": "array", "items": {"type": "object", "properties": {
            "text": {"type": S}, "label": {"enum": ["PERSON", "ORG", "LOC", "DATE"]},
            "start": {"type": "integer", "minimum": 0}}, "required": ["text", "label"]}}},
      "required": ["entities"]},
     {"entities": [{"text": "Ada", "label": "PERSON", "start": 0}]}),
    ({"type": "object", "properties": {
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"},
                                              "minItems": 2, "maxItems": 2},
                   "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
     {"matrix": [[1, 0], [0, 1]]}),
    ({"type": "object", "properties": {
        "url": {"type": S, "format": "uri"}, "status": {"type": "integer", "enum": [200, 301, 404]},
        "headers": {"type": "object", "additionalProperties": {"type": S}}},
      "required": ["url", "status"]},
     {"url": "https://example.com/", "status": 200, "headers": {"server": "kvflow"}}),
    ({"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 3}}, "required": ["value"]}},
      "$ref": "#/$defs/node"}, {"value": 1, "children": [{"value": 2}]}),
    ({"type": "object", "properties": {
        "product": {"type": S}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}, "dimensions": {"type": "object", "properties": {
            "w": {"type": "number"}, "h": {"type": "number"}, "d": {"type": "number"}},
            "required": ["w", "h", "d"]}}, "required": ["product", "price", "in_stock"]},
     {"product": "lamp", "price": 19.99, "in_stock": True, "dimensions": {"w": 1, "h": 2, "d": 3}}),
    ({"type": "object", "properties": {
        "first_name": {"type": S}, "last_name": {"type": S}, "middle": {"type": ["string", "null"]},
        "dob": {"type": S, "format": "date"}}, "required": ["first_name", "last_name"]},
     {"first_name": "Grace", "last_name": "Hopper", "middle": None, "dob": "1906-12-09"}),
    ({"type": "object", "properties": {
        "question": {"type": S}, "options": {"type": "array", "items": {"type": S},
                                             "minItems": 2, "maxItems": 4},
        "correct": {"type": "integer", "minimum": 0, "maximum": 3}},
      "required": ["question", "options", "correct"]},
     {"question": "2+2?", "options": ["3", "4"], "correct": 1}),
    ({"type": "object", "properties": {
        "log_level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "message": {"type": S},
        "timestamp": {"type": S, "format": "date-time"}, "context": {"type": "object"}},
      "required": ["log_level", "message", "timestamp"]},
     {"log_level": "INFO", "message": "ok", "timestamp": "2026-12-01T16:00:00Z", "context": {}}),
]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def instance_tokens(tokenizer) -> list[list[int]]:
    out = []
    for schema, inst in SCHEMAS:
        jsonschema.validate(inst, schema)
        out.append(tokenizer.encode(json.dumps(inst, separators=(",", ":")),
                                    add_special_tokens=False))
    return out


def bench_xgrammar(tokenizer, batch: int, threads: int) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    setup = time.perf_counter() - t0
    compile_s, compiled = [], []
    for schema, _ in SCHEMAS:
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        t0 = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(",", ":")))
        compile_s.append(time.perf_counter() - t0)
    tokens = instance_tokens(tokenizer)
    matchers = [xgr.GrammarMatcher(compiled[i % len(SCHEMAS)]) for i in range(batch)]
    walks = [tokens[i % len(SCHEMAS)] for i in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, len(tokenizer))
    filler = xgr.BatchGrammarMatcher(max_threads=threads)
    logits = torch.randn(batch, len(tokenizer))
    fill_s, apply_s = [], []
    for step in range(max(map(len, walks))):
        t0 = time.perf_counter()
        filler.batch_fill_next_token_bitmask(matchers, bitmask)
        fill_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        apply_s.append(time.perf_counter() - t0)
        for m, w in zip(matchers, walks):
            if step < len(w):
                assert m.accept_token(w[step]), "the instance's tokens are valid"
    return {"setup_s": setup, "compile_s": compile_s, "fill_s": fill_s, "apply_s": apply_s}


def bench_llguidance(tokenizer, batch: int, threads: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    setup = time.perf_counter() - t0
    # lenient: keywords llguidance does not implement (uniqueItems) are ignored, as xgrammar does
    opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
            "lenient": True}
    grammars, compile_s = [], []
    one = np.zeros((1, (len(tokenizer) + 31) // 32), dtype=np.int32)
    for schema, _ in SCHEMAS:
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts)
        m = llguidance.LLMatcher(lltok, g)
        llguidance.numpy.fill_next_token_bitmask(m, one)  # the lexer is built lazily: count it
        assert not m.is_error(), m.get_error()
        compile_s.append(time.perf_counter() - t0)
        grammars.append(g)
    tokens = instance_tokens(tokenizer)
    matchers = [llguidance.LLMatcher(lltok, grammars[i % len(SCHEMAS)]) for i in range(batch)]
    walks = [tokens[i % len(SCHEMAS)] for i in range(batch)]
    bitmask = np.zeros((batch, (len(tokenizer) + 31) // 32), dtype=np.int32)
    executor = llguidance.LLExecutor(num_threads=threads)
    fill_s = []
    for step in range(max(map(len, walks))):
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fill_s.append(time.perf_counter() - t0)
        for m, w in zip(matchers, walks):
            if step < len(w):
                assert m.consume_token(w[step]), m.get_error()
    return {"setup_s": setup, "compile_s": compile_s, "fill_s": fill_s}


def report(name: str, r: dict, batch: int) -> None:
    c, f = r["compile_s"], r["fill_s"][1:]  # the first fill of fresh matchers is a warm-up
    print(f"{name}: tokenizer set-up {r['setup_s']:.2f} s; compile of {len(c)} schemas "
          f"p50 {statistics.median(c) * 1e3:.1f} ms, p99 {pct(c, 0.99) * 1e3:.1f} ms, "
          f"max {max(c) * 1e3:.1f} ms; mask fill at batch {batch}: p50 "
          f"{statistics.median(f) * 1e3:.2f} ms, p99 {pct(f, 0.99) * 1e3:.2f} ms per step "
          f"({statistics.median(f) / batch * 1e6:.1f} us per row)"
          + (f"; apply p50 {statistics.median(r['apply_s']) * 1e3:.2f} ms" if "apply_s" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="threads each backend may use")
    ap.add_argument("--backends", default="xgrammar,llguidance")
    args = ap.parse_args()
    tokenizer = get_tokenizer(default_model_path())
    print(f"{len(SCHEMAS)} schemas, vocab {len(tokenizer)}, batch {args.batch}, "
          f"threads {args.threads}")
    for name in args.backends.split(","):
        fn = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}[name]
        report(name, fn(tokenizer, args.batch, args.threads), args.batch)


if __name__ == "__main__":
    main()
