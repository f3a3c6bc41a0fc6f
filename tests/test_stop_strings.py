"""Stop-string matching: the indexed matcher (many stops) gives exactly what scanning every stop
gives, on random texts, windows and stop lists, and so does the detokenizer built on it."""
import random

import pytest

from kvflow.engine.detokenizer import IncrementalDetokenizer, StopStrings
from kvflow.sampling_params import SamplingParams


# -- the reference: what the detokenizer did before the index, every stop scanned ------------
def reference_find(stops: list[str], text: str, start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def reference_held_back(stops: list[str], text: str, limit: int) -> int:
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, limit), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def random_stops(rng: random.Random, count: int, alphabet: str) -> list[str]:
    return [''.join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(count)]


@pytest.mark.parametrize("count", [1, 3, 8, 9, 40, 500])
def test_matcher_equals_scanning_every_stop(count):
    rng = random.Random(count)
    alphabet = "abcab "  # few letters: many overlaps, ties and shared prefixes
    for _ in range(400):
        stops = random_stops(rng, count, alphabet)
        if rng.random() < 0.3:
            stops += rng.sample(stops, min(3, len(stops)))  # duplicates keep the first position
        matcher = StopStrings(stops)
        assert matcher.indexed == (len(stops) > StopStrings.SCAN_UP_TO)
        text = ''.join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        start = rng.randint(0, len(text))
        assert matcher.find(text, start) == reference_find(stops, text, start)
        limit = rng.randint(0, len(text))
        assert matcher.held_back(text, limit) == reference_held_back(stops, text, limit)


class CharTokenizer:
    """One token per character (ids are code points): enough to drive the detokenizer."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return ''.join(chr(i) for i in ids)


class ReferenceDetokenizer(IncrementalDetokenizer):
    """The detokenizer with the old scan-every-stop matching."""

    def _check_stop(self, old_len: int) -> None:
        start = max(0, old_len - max(len(s) for s in self.stop) + 1, self._sent)
        best = reference_find(self.stop, self.output_text, start)
        if best is None:
            return
        i, s = best
        self.output_text = self.output_text[:i + len(s) if self.include_stop else i]
        self.stop_reason = s
        self.finished = True

    def _held_back(self) -> int:
        return reference_held_back(self.stop, self.output_text, len(self.output_text) - self._sent)


@pytest.mark.parametrize("count", [2, 50])
def test_detokenizer_streams_exactly_as_before(count):
    rng = random.Random(100 + count)
    tok = CharTokenizer()
    for _ in range(200):
        stops = random_stops(rng, count, "abc")
        params = SamplingParams(stop=stops, include_stop_str_in_output=rng.random() < 0.5,
                                min_tokens=rng.choice([0, 0, 3]), max_tokens=64)
        new, old = IncrementalDetokenizer(tok, [32], params), ReferenceDetokenizer(tok, [32], params)
        text = [ord(c) for c in ''.join(rng.choice("abcd") for _ in range(40))]
        pos = 0
        while pos < len(text):
            step = text[pos:pos + rng.randint(1, 3)]
            pos += len(step)
            last = pos >= len(text)
            assert new.update(step, last) == old.update(step, last)
            assert new.get_delta() == old.get_delta()
            if new.finished:
                break
        assert (new.output_text, new.stop_reason) == (old.output_text, old.stop_reason)


def test_many_stop_strings_cost_does_not_grow_with_their_number(monkeypatch):
    """Counted, not timed: the dict lookups of one step with 100k stops stay within the window
    times the distinct lengths."""
    stops = [f"{i:06d}" for i in range(100_000)]  # one length
    matcher = StopStrings(stops)
    lookups = 0
    real = matcher._first

    class Counting(dict):
        def get(self, key, default=None):
            nonlocal lookups
            lookups += 1
            return real.get(key, default)

    matcher._first = Counting()
    text = "x" * 100 + "12345" + "y" * 20  # digits: every position a possible head
    assert matcher.find(text, 95) is None
    assert lookups <= len(text) - 95
    assert matcher.find("ab000123", 0) == (2, "000123")
