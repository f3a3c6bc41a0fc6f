"""Structured outputs: decoding constrained by a JSON schema, regex, choice or grammar.

    backends.py  the grammar libraries behind one interface: llguidance (the default, chosen by
                 measurement: benchmarks/structured_backends.py) and xgrammar
    manager.py   StructuredOutputManager: compiles grammars off the step loop (a thread pool,
                 a compile cache keyed by StructuredOutputsParams.key()) and fills the bitmask
                 of every constrained row of a step in one batch call

The scheduler holds each request's StructuredOutputRequest (its matcher) and advances it once
per sampled token; the runner adds the bitmask to the logits before sampling."""
from kvflow.structured.backends import BACKENDS, resolve_backend, validate_structured_outputs
from kvflow.structured.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["BACKENDS", "StructuredOutputManager", "StructuredOutputRequest", "resolve_backend",
           "validate_structured_outputs"]
