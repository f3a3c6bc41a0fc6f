"""The grammar libraries behind one small interface.

A backend turns StructuredOutputsParams into a compiled grammar (cached by the manager), makes
one matcher per request from it, and fills the next-token bitmask of many matchers in one
call. The bitmask is int32 [rows, ceil(vocab / 32)], bit j of word w allowing token 32 w + j
(both libraries' layout). Neither library is imported until a backend is built, and
llguidance never imports torch, so a frontend can validate a constraint cheaply.

JSON is compiled compact-ish (", " and ": ", no free whitespace): a small model given free
whitespace can emit newlines until max_tokens instead of closing the object."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from kvflow.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "llguidance", "xgrammar")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def resolve_backend(name: str) -> str:
    """`auto` is llguidance: it compiled our schemas ~6x faster at p50 and >300x at the worst
    (ms, not up to 0.8 s), rejects the schema keywords it cannot enforce instead of ignoring
    them, and imports without torch (benchmarks/README.md)."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, "
                         f"got {name!r}")
    return "llguidance" if name == "auto" else name


# -- llguidance ---------------------------------------------------------------------------------
_LLG_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet checked)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = no_extra_properties(json.loads(params.json)) if kind == "json" \
            else JSON_OBJECT_SCHEMA
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_LLG_JSON)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted


_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
              "unevaluatedItems", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def no_extra_properties(schema):
    """The schema with `additionalProperties: false` wherever an object lists its `properties`
    and says nothing of others (xgrammar's strict mode, OpenAI's strict schemas): an instance
    of it is still valid, and a small model cannot wander off into keys of its own. Only
    subschemas are visited (never `enum` or `const` values)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA:
        if isinstance(out.get(k), dict):
            out[k] = no_extra_properties(out[k])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [no_extra_properties(s) for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: no_extra_properties(s) for name, s in out[k].items()}
    if "properties" in out and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


class LLGuidanceBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, params: StructuredOutputsParams) -> str:
        grammar = llguidance_grammar(params)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: str) -> "LLGuidanceMatcher":
        m = self._llg.LLMatcher(self.tokenizer, compiled)
        # llguidance builds its lexer lazily: the first mask (up to ~20 ms for a large schema)
        # is computed here, in the compile thread, not in the step's batch fill
        m.compute_bitmask()
        return LLGuidanceMatcher(m)

    def fill_bitmask(self, matchers: list["LLGuidanceMatcher"], bitmask: np.ndarray) -> None:
        # one call for the batch; it releases the GIL while it works
        self.executor.unsafe_compute_mask_ptr([(m.m, i) for i, m in enumerate(matchers)],
                                              bitmask.ctypes.data, bitmask.shape[1] * 4,
                                              bitmask.shape[0])


class LLGuidanceMatcher:
    __slots__ = ("m",)

    def __init__(self, m) -> None:
        self.m = m
        if m.is_error():
            raise ValueError(m.get_error())

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts; the state is unchanged."""
        return self.m.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None


# -- xgrammar -----------------------------------------------------------------------------------
def xgrammar_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of a constraint: building it is xgrammar's check of the constraint."""
    import xgrammar as xgr

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else JSON_OBJECT_SCHEMA
        ignored = sorted(xgrammar_ignored_keywords(json.loads(schema)))
        if ignored:
            raise ValueError(f"keywords the xgrammar backend does not enforce: {ignored}")
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
    if "::=" in params.grammar:  # EBNF (GBNF), else Lark
        return xgr.Grammar.from_ebnf(params.grammar)
    return xgr.Grammar.from_lark(params.grammar)


# xgrammar 0.2.8 accepts these and generates instances that break them (checked by hand:
# [1, 1] under uniqueItems, 1 under {"not": {"type": "integer"}}, ...): refused, never ignored
_XGRAMMAR_IGNORES = {"uniqueItems", "contains", "minContains", "maxContains", "not",
                     "dependentRequired", "dependentSchemas", "if", "then", "else"}
_NOT_SCHEMAS = ("enum", "const", "default", "examples")


def xgrammar_ignored_keywords(schema) -> set[str]:
    found = set()
    if isinstance(schema, list):
        for s in schema:
            found |= xgrammar_ignored_keywords(s)
    elif isinstance(schema, dict):
        found |= _XGRAMMAR_IGNORES.intersection(schema)
        for k, v in schema.items():
            if k in _SUBSCHEMA_MAPS and isinstance(v, dict):  # its keys are names, not keywords
                for sub in v.values():
                    found |= xgrammar_ignored_keywords(sub)
            elif k not in _NOT_SCHEMAS:
                found |= xgrammar_ignored_keywords(v)
    return found


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, params: StructuredOutputsParams):
        try:
            return self.compiler.compile_grammar(xgrammar_grammar(params))
        except (RuntimeError, self._xgr.InvalidJSONError) as e:
            raise ValueError(str(e)) from None

    def matcher(self, compiled) -> "XGrammarMatcher":
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, matchers: list["XGrammarMatcher"], bitmask: np.ndarray) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask([m.m for m in matchers], torch.from_numpy(bitmask))


class XGrammarMatcher:
    __slots__ = ("m",)
    error = None

    def __init__(self, m) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts; the state is unchanged."""
        n = 0
        while n < len(tokens) and not self.m.is_terminated() and self.m.accept_token(tokens[n]):
            n += 1
        self.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


def make_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    cls = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}[resolve_backend(name)]
    return cls(tokenizer, vocab_size, eos_token_ids)


# -- validation at the boundary -------------------------------------------------------------------
_validated: OrderedDict[tuple, None] = OrderedDict()  # (backend, key) of valid constraints
_validated_lock = threading.Lock()
_MAX_VALIDATED = 1024


def _validate(backend: str, params: StructuredOutputsParams) -> None:
    try:
        if backend == "llguidance":
            import llguidance

            error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(params))
            if error:
                raise ValueError(error)
        else:
            xgrammar_grammar(params)
    except (ValueError, RuntimeError) as e:
        what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[params.kind]
        detail = str(e).strip().splitlines()
        raise ValueError(f"structured_outputs.{params.kind}: unsupported or invalid {what}: "
                         f"{' '.join(detail)[:500]}") from None


def validate_structured_outputs(params: StructuredOutputsParams, backend: str = "auto") -> None:
    """ValueError naming the problem when `backend` cannot enforce this constraint (an invalid
    regex or grammar, a schema keyword it does not implement); no tokenizer needed, cached by
    the constraint. The frontends call it before admission (a 400), EngineCore again."""
    name = resolve_backend(backend)
    key = (name, params.key())
    with _validated_lock:  # the server validates on its tokenizer thread and on the event loop
        if key in _validated:
            _validated.move_to_end(key)
            return
    _validate(name, params)
    with _validated_lock:
        _validated[key] = None
        if len(_validated) > _MAX_VALIDATED:
            _validated.popitem(last=False)
