"""StructuredOutputManager: grammars compile off the step loop, masks fill in one batch call.

vLLM V1's shape: a request with a constraint gets a StructuredOutputRequest whose matcher is
built in a one-thread pool (the backend, and the tokenizer it needs, are made there on first
use, so the engine never loads a tokenizer unless a constrained request comes); the scheduler
passes it over (`waiting_for_grammar`) until `is_ready()`, then advances it once per sampled
token. Each step, `grammar_bitmask` fills the bitmask of every constrained row that samples."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvflow.logger import init_logger
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured.backends import make_backend, resolve_backend

logger = init_logger("kvflow.structured")
MAX_CACHED_GRAMMARS = 256


class GrammarBitmask:
    """The step's masks: request `req_ids[i]` has `num_rows[i]` consecutive rows of `bitmask`
    (int32 [sum(num_rows), ceil(vocab / 32)]), one per position it samples at: 1, or k + 1
    with k speculative drafts (row r allows what the grammar allows after its first r drafts).
    The fill may still be running (beside the step's forward): reading `bitmask` waits for
    it. `also_allowed` (row -> token) are set on top of the grammar's once the fill is done
    (a reasoning's start token)."""

    __slots__ = ("req_ids", "num_rows", "_bitmask", "_fill", "_also")

    def __init__(self, req_ids: list[str], bitmask: np.ndarray, fill: Future | None = None,
                 also_allowed: dict[int, int] | None = None,
                 num_rows: list[int] | None = None) -> None:
        self.req_ids = req_ids
        self.num_rows = num_rows or [1] * len(req_ids)
        self._bitmask = bitmask
        self._fill = fill
        self._also = also_allowed or None
        if fill is None:
            self._allow_also()

    def _allow_also(self) -> None:
        if self._also:
            words = self._bitmask.view(np.uint32)
            for row, token in self._also.items():
                if 0 <= token < words.shape[1] * 32:
                    words[row, token >> 5] |= np.uint32(1 << (token & 31))
        self._also = None

    @property
    def bitmask(self) -> np.ndarray:
        self.wait()
        return self._bitmask

    def wait(self) -> None:
        """Until the fill is done (it raises what the fill raised); the matchers may not
        advance before."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill.result()
            self._allow_also()


class StructuredOutputRequest:
    """One request's constraint: compiling (a future), then its matcher, or the compile error."""

    __slots__ = ("params", "_future", "matcher", "error")

    def __init__(self, params: StructuredOutputsParams, future: Future) -> None:
        self.params = params
        self._future: Future | None = future
        self.matcher = None
        self.error: str | None = None

    def is_ready(self) -> bool:
        """True once compiled (or failed: then `error` says why); never blocks."""
        f = self._future
        if f is None:
            return True
        if not f.done():
            return False
        self._future = None
        try:
            self.matcher = f.result()
        except Exception as e:  # noqa: BLE001 - any compile failure ends this request only
            self.error = str(e) or type(e).__name__
        return True

    def accept(self, token: int) -> bool:
        return self.matcher.accept(token)

    def validate_drafts(self, tokens: list[int]) -> int:
        """How many leading speculative drafts its grammar accepts (the matcher is left as it
        was): the rest are cut before they are scheduled."""
        return self.matcher.validate(tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def close(self) -> None:
        """Cancel a compile still queued; drop the matcher."""
        if self._future is not None:
            self._future.cancel()
            self._future = None
        self.matcher = None


class StructuredOutputManager:
    """Compiles constraints in a background thread with a compile cache keyed by
    `StructuredOutputsParams.key()`, and fills each step's bitmask in one batch call.
    `load_tokenizer` is called once, in the compile thread, on the first constrained request."""

    def __init__(self, backend: str, load_tokenizer: Callable[[], object], vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        self.backend_name = resolve_backend(backend)
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._eos = list(eos_token_ids)
        self._backend = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None
        self.num_compiles = 0  # cache misses, for tests and stats

    def _get_backend(self):
        if self._backend is None:
            self._backend = make_backend(self.backend_name, self._load_tokenizer(),
                                         self.vocab_size, self._eos)
        return self._backend

    def _build(self, params: StructuredOutputsParams):
        """In the compile thread: the cached compiled grammar (or a fresh compile), then a
        matcher of this request's own."""
        backend = self._get_backend()
        key = params.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = backend.compile(params)
            with self._lock:
                self.num_compiles += 1
                self._cache[key] = compiled
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return backend.matcher(compiled)

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start compiling `params` for one request; returns at once."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvflow-grammar")
        return StructuredOutputRequest(params, self._pool.submit(self._build, params))

    def grammar_bitmask(self, req_ids: list[str], states: list[StructuredOutputRequest],
                        background: bool = True,
                        also_allowed: dict[str, int] | None = None,
                        drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        """The masks of these ready requests at each position they sample: one row each, or
        k + 1 rows for a request with k `drafts` (request id -> drafts its matcher accepts);
        filled in one batch call per draft depth, in the fill thread when `background` (both
        libraries release the GIL while they fill, so the step's forward runs meanwhile), the
        caller waiting (GrammarBitmask.wait) before any matcher advances. `also_allowed`:
        request id -> a token its row allows besides."""
        ks = [len(drafts.get(rid, ())) if drafts else 0 for rid in req_ids]
        num_rows = [k + 1 for k in ks]
        first = np.concatenate(([0], np.cumsum(num_rows)[:-1])).astype(np.int64).tolist()
        bitmask = np.zeros((sum(num_rows), (self.vocab_size + 31) // 32), dtype=np.int32)
        matchers = [s.matcher for s in states]
        also = ({first[req_ids.index(rid)]: t for rid, t in also_allowed.items()}
                if also_allowed else None)
        if any(ks):
            order = [drafts.get(rid, []) for rid in req_ids]
            work, args = self._fill_with_drafts, (matchers, order, first, bitmask)
        else:
            work, args = self._backend.fill_bitmask, (matchers, bitmask)
        if not background:
            work(*args)
            return GrammarBitmask(req_ids, bitmask, also_allowed=also, num_rows=num_rows)
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="kvflow-mask")
        return GrammarBitmask(req_ids, bitmask, self._fill_pool.submit(work, *args),
                              also_allowed=also, num_rows=num_rows)

    def _fill_with_drafts(self, matchers: list, drafts: list[list[int]], first: list[int],
                          bitmask: np.ndarray) -> None:
        """Row first[j] + i of `bitmask`: matcher j's mask after its drafts[j][:i]. Each depth
        is one batch fill; then the matchers still drafting advance by one draft; at the end
        each rolls back what it advanced, so every matcher is left as it was."""
        advanced = [0] * len(matchers)
        try:
            for i in range(max(map(len, drafts)) + 1):
                live = [j for j, d in enumerate(drafts) if len(d) >= i]
                rows = np.zeros((len(live), bitmask.shape[1]), dtype=np.int32)
                self._backend.fill_bitmask([matchers[j] for j in live], rows)
                bitmask[[first[j] + i for j in live]] = rows
                for j in live:
                    if i < len(drafts[j]):
                        if not matchers[j].accept(drafts[j][i]):  # validated when proposed
                            raise RuntimeError(f"draft token {drafts[j][i]} left its grammar")
                        advanced[j] += 1
        finally:
            for m, n in zip(matchers, advanced):
                m.rollback(n)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=True)
            self._fill_pool = None
