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
    """The step's masks: row i of `bitmask` (int32 [len(req_ids), ceil(vocab / 32)]) is the
    allowed next tokens of request `req_ids[i]`. The fill may still be running (beside the
    step's forward): reading `bitmask` waits for it. `also_allowed` (row -> token) are set
    on top of the grammar's once the fill is done (a reasoning's start token)."""

    __slots__ = ("req_ids", "_bitmask", "_fill", "_also")

    def __init__(self, req_ids: list[str], bitmask: np.ndarray, fill: Future | None = None,
                 also_allowed: dict[int, int] | None = None) -> None:
        self.req_ids = req_ids
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
                        also_allowed: dict[str, int] | None = None) -> GrammarBitmask:
        """The next-token masks of these ready requests, filled in one batch call; in the fill
        thread when `background` (both libraries release the GIL while they fill, so the
        step's forward runs meanwhile), the caller waiting (GrammarBitmask.wait) before any
        matcher advances. `also_allowed`: request id -> a token its row allows besides."""
        bitmask = np.zeros((len(states), (self.vocab_size + 31) // 32), dtype=np.int32)
        matchers = [s.matcher for s in states]
        also = ({req_ids.index(rid): t for rid, t in also_allowed.items()}
                if also_allowed else None)
        if not background:
            self._backend.fill_bitmask(matchers, bitmask)
            return GrammarBitmask(req_ids, bitmask, also_allowed=also)
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="kvflow-mask")
        return GrammarBitmask(req_ids, bitmask,
                              self._fill_pool.submit(self._backend.fill_bitmask, matchers, bitmask),
                              also_allowed=also)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=True)
            self._fill_pool = None
