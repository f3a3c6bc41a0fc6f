"""Sampling parameters (OpenAI-shaped, validated on construction) and the decoding constraint
of a request (StructuredOutputsParams, vLLM's names)."""
from __future__ import annotations

import json as jsonlib
import math
from dataclasses import dataclass

from kvflow.kv_transfer.params import KVTransferParams

# Caps on what one request may ask for. OpenAI caps logprobs at 20, chat stop strings at 4 and
# logit_bias at 300 entries; vLLM caps none of the lists. These bound the per-token work (stop
# strings are scanned on every token, banned and biased ids are scattered every step) and keep
# every integer inside what the frontend -> core messages (64-bit msgpack) can carry.
MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias in [-100, 100]
MAX_COUNT = 2**31 - 1  # max_tokens, min_tokens, top_k and token ids: far past any model
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed and msgpack take


def find_lone_surrogate(text: str) -> int | None:
    """Index of the first lone UTF-16 surrogate (from a JSON escape like "\\ud800"), else None.
    Such a string cannot be encoded as UTF-8: not by the tokenizer, not on the wire."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_text(name: str, text: str) -> None:
    """ValueError naming `name` when `text` holds a lone surrogate."""
    at = find_lone_surrogate(text)
    if at is not None:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate "
                         f"(\\u{ord(text[at]):04x}) at position {at}")


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    """ValueError naming `name` when an id is not an integer in [0, vocab_size)."""
    if not ids:
        return
    # one pass over every id: a float or bool between two ints must not slip through
    bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} contains token id {bad!r}, outside the vocabulary "
                         f"[0, {vocab_size})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema's JSON text, a grammar, a regex
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_REASONING_END_TOKENS = 16  # `</think>` is one or a few tokens in any tokenizer


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice`
    (the output is one of these strings), `grammar` (EBNF / Lark), or `json_object=True` (any
    JSON object, OpenAI's `response_format={"type": "json_object"}`). A schema is kept as
    compact JSON text in its own key order (the order the grammar generates its properties
    in), which is also the compile cache's key.

    `reasoning_end_token_ids` (set by the server's `--reasoning-parser`): the output begins in
    reasoning, free, and the constraint applies from the token after the first contiguous run
    of these ids (`</think>`) in the output on; until then no mask and no matcher advance.
    With `reasoning_start_token_ids` too (qwen3: `<think>`), the output reasons only if it
    begins with that run: its first tokens are masked by the grammar with the run's next token
    also allowed, and once the output leaves the run the constraint holds from its first token
    (the matcher is fed what was generated; keep the run one token, as `<think>` is in the
    tokenizers that think, so that nothing unchecked comes before). Neither changes the
    grammar, so neither is part of `key()`."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning_end_token_ids: list[int] | None = None
    reasoning_start_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar "
                             f"or json_object, got {', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            # keys keep their order: a schema's property order is the order the grammar
            # generates them in, so two orders are two grammars (and two cache entries)
            self.json = jsonlib.dumps(schema, separators=(",", ":"))
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices, "
                                 f"got {len(self.choice)}")
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError("structured_outputs.choice: each choice must be a non-empty "
                                     f"string of at most {MAX_CHOICE_CHARS} characters")
        for name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if text is None:
                continue
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if len(text) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.{name}: at most {MAX_CONSTRAINT_CHARS} "
                                 f"characters, got {len(text)}")
        for text in [self.json, self.regex, self.grammar, *(self.choice or ())]:
            if text is not None and find_lone_surrogate(text) is not None:
                raise ValueError("structured_outputs contains a lone surrogate")
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            ids = getattr(self, name)
            if ids is None:
                continue
            if (not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_REASONING_END_TOKENS
                    or not all(isinstance(t, int) and not isinstance(t, bool)
                               and 0 <= t <= MAX_COUNT for t in ids)):
                raise ValueError(f"structured_outputs.{name} must be 1 to "
                                 f"{MAX_REASONING_END_TOKENS} token ids")
            setattr(self, name, list(ids))
        if self.reasoning_start_token_ids is not None:
            if self.reasoning_end_token_ids is None:
                raise ValueError("structured_outputs.reasoning_start_token_ids needs "
                                 "reasoning_end_token_ids")
            # the first output token decides whether the output reasons: a longer run would
            # leave tokens the grammar never masked
            if len(self.reasoning_start_token_ids) != 1:
                raise ValueError("structured_outputs.reasoning_start_token_ids must be one token")

    @property
    def kind(self) -> str:
        """json | regex | choice | grammar | json_object."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    def key(self) -> tuple:
        """What the compiled grammar depends on: the compile cache's key."""
        value = getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value)


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy. `top_k=0` (or -1) disables top-k.
    `logit_bias` maps token id -> bias in [-100, 100], added to the logits before sampling
    (OpenAI's semantics: -100 bans a token, +100 all but forces it)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: for each prompt position after the first, the prompt's token and the top-N
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # a decoding constraint (JSON schema, regex, choice, grammar), compiled in the engine
    structured_outputs: StructuredOutputsParams | None = None
    # prefill/decode disaggregation (vLLM's field): lend the prompt's blocks, or pull them
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # counted before any per-item work, so that a huge list costs nothing more
        if self.stop is not None and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(self.logit_bias)}")
        self.stop = [s for s in (self.stop or []) if s] or None
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else None
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            finite(name, getattr(self, name))
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_COUNT:
            raise ValueError(f"top_k must be -1 (disable) or in [1, {MAX_COUNT}], got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or not 1 <= self.max_tokens <= MAX_COUNT):
            raise ValueError(f"max_tokens must be in [1, {MAX_COUNT}], got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_COUNT:
            raise ValueError(f"min_tokens must be in [0, {MAX_COUNT}], got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs!r}")
        if self.seed is not None:
            if not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
            if self.seed + self.n - 1 > SEED_MAX:  # sample i of n draws with seed + i
                raise ValueError(f"seed must be at most 2**64 - n ({SEED_MAX - self.n + 1} with "
                                 f"n={self.n}): sample i is seeded with seed + i")
        for s in self.stop or ():
            if not isinstance(s, str):
                raise ValueError(f"stop must be strings, got {type(s).__name__}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: each stop string may have at most "
                                 f"{MAX_STOP_STRING_CHARS} characters, got {len(s)}")
            check_text("stop", s)
        for t in self.stop_token_ids or ():
            if not _is_int(t) or not 0 <= t <= MAX_COUNT:
                raise ValueError(f"stop_token_ids contains {t!r}, not a token id")
        for t, bias in (self.logit_bias or {}).items():
            if not _is_int(t) or not 0 <= t <= MAX_COUNT:
                raise ValueError(f"logit_bias has key {t!r}, not a token id")
            if not isinstance(bias, (int, float)) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias of token {t} must be in [-100, 100], got {bias!r}")

    def verify_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field when an id or top_k lies outside the model's vocabulary;
        run at the boundary (server, `LLM`) before the request reaches the engine."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias", list(self.logit_bias or ()), vocab_size)
        so = self.structured_outputs
        if so is not None:
            check_token_ids("structured_outputs.reasoning_end_token_ids",
                            so.reasoning_end_token_ids, vocab_size)
            check_token_ids("structured_outputs.reasoning_start_token_ids",
                            so.reasoning_start_token_ids, vocab_size)
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1 (disable) or at most the vocabulary size "
                             f"{vocab_size}, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
