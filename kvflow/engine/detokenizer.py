"""Incremental detokenizer: token ids in, text deltas out, stop strings cut.

Each step decodes only a short window of tokens (vLLM's prefix_offset / read_offset), so the
cost per token stays constant however long the output grows. The window starts a few tokens
back so that tokenizers whose lone-token decode differs from in-context decode (leading
spaces, byte pieces of one character spread over several tokens) come out right.
"""
from __future__ import annotations

from bisect import bisect_right

from kvflow.sampling_params import SamplingParams

# Tokens of context decoded before the first new token (vLLM uses the same 5).
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class StopStrings:
    """A request's stop strings: the earliest match in a window of text, and the longest tail
    of the text that could still grow into one.

    A handful are scanned one by one (str.find in C beats any index). Beyond that, matching
    looks up each window position's substrings of the stop lengths in a dict, and the hold-back
    bisects the sorted stops, so the cost per step depends on the window (max_len + new
    text) and the number of distinct lengths, never on how many stop strings there are."""

    SCAN_UP_TO = 8

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self.indexed = len(stops) > self.SCAN_UP_TO
        if self.indexed:
            self._first: dict[str, int] = {}  # stop -> its first position in the list
            for i, stop in enumerate(stops):
                self._first.setdefault(stop, i)
            self._lengths = sorted({len(stop) for stop in stops})
            self._heads = frozenset(stop[0] for stop in stops)
            self._sorted = sorted(self._first)

    def find(self, text: str, start: int) -> tuple[int, str] | None:
        """The match that begins first at or after `start` (the earlier-listed stop on a tie)."""
        if not self.indexed:
            best: tuple[int, str] | None = None
            for stop in self.stops:
                i = text.find(stop, start)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, stop)
            return best
        n, first, lengths = len(text), self._first, self._lengths
        for i in range(start, n):
            if text[i] not in self._heads:
                continue
            hit = None
            for k in lengths:
                if i + k > n:
                    break
                j = first.get(text[i:i + k])
                if j is not None and (hit is None or j < hit):
                    hit = j
            if hit is not None:
                return i, self.stops[hit]
        return None

    def held_back(self, text: str, limit: int) -> int:
        """Length of the longest suffix of `text`, at most `limit` chars, that is a proper
        prefix of a stop string (0 if none)."""
        if not self.indexed:
            held = 0
            for stop in self.stops:
                for k in range(min(len(stop) - 1, limit), held, -1):
                    if text.endswith(stop[:k]):
                        held = k
                        break
            return held
        stops = self._sorted
        for k in range(min(self.max_len - 1, limit, len(text)), 0, -1):
            tail = text[-k:]
            # the smallest stop above `tail` starts with it if any longer stop does
            j = bisect_right(stops, tail)
            if j < len(stops) and stops[j].startswith(tail):
                return k
        return 0


def decode_token(tokenizer, token_id: int) -> str:
    """Text of one token alone, as shown next to its logprob."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, step by step.

    `update()` appends tokens and reports a matched stop string; `get_delta()` returns the
    text that is safe to show now. Joined deltas always equal the final `output_text`.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 stops: StopStrings | None = None):
        """`stops`: the StopStrings of `params.stop`, when built already (shared by the `n`
        samples of one request, so that many stop strings are indexed once)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._stops = stops if stops is not None else StopStrings(list(params.stop or []))
        self.stop = self._stops.stops
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens

        self.token_ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._sent = 0  # chars of output_text already returned by get_delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_window(self, flush: bool) -> str:
        """New text from tokens past read_offset; empty while it ends in a partial character."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and (flush or not full.endswith(_REPLACEMENT)):
            # Slide the window: what was new becomes the context of the next step.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix):]
        return ""

    def update(self, new_token_ids: list[int], finished: bool = False) -> str | None:
        """Append generated tokens; return the stop string they completed, if any.

        `finished=True` (the request ends for any reason) releases held-back text.
        """
        if self.finished:
            return None
        self.token_ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        old_len = len(self.output_text)
        self.output_text += self._decode_window(flush=finished)
        self.finished = finished
        if self.stop and self.num_output_tokens > self.min_tokens:
            self._check_stop(old_len)
        return self.stop_reason

    def _check_stop(self, old_len: int) -> None:
        # A match must end in the new text, so it starts at most max_len - 1 chars before it
        # (and never in text already shown, which min_tokens may have let through).
        start = max(0, old_len - self._stops.max_len + 1, self._sent)
        best = self._stops.find(self.output_text, start)
        if best is None:
            return
        i, s = best
        self.output_text = self.output_text[:i + len(s) if self.include_stop else i]
        self.stop_reason = s
        self.finished = True

    def _held_back(self) -> int:
        """Length of the longest suffix of output_text that could still grow into a stop string."""
        if not self.stop:
            return 0
        return self._stops.held_back(self.output_text, len(self.output_text) - self._sent)

    def get_delta(self) -> str:
        """Text not yet returned that can no longer change or turn into a stop string."""
        end = len(self.output_text)
        if not self.finished:
            end -= self._held_back()
        delta = self.output_text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta
