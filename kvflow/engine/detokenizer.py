"""Incremental detokenizer: token ids in, text deltas out, stop strings cut.

Each step decodes only a short window of tokens (vLLM's prefix_offset / read_offset), so the
cost per token stays constant however long the output grows. The window starts a few tokens
back so that tokenizers whose lone-token decode differs from in-context decode (leading
spaces, byte pieces of one character spread over several tokens) come out right.
"""
from __future__ import annotations

from kvflow.sampling_params import SamplingParams

# Tokens of context decoded before the first new token (vLLM uses the same 5).
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def decode_token(tokenizer, token_id: int) -> str:
    """Text of one token alone, as shown next to its logprob."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, step by step.

    `update()` appends tokens and reports a matched stop string; `get_delta()` returns the
    text that is safe to show now. Joined deltas always equal the final `output_text`.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

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
        start = max(0, old_len - self._max_stop_len + 1, self._sent)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self.output_text = self.output_text[:i + len(s) if self.include_stop else i]
        self.stop_reason = s
        self.finished = True

    def _held_back(self) -> int:
        """Length of the longest suffix of output_text that could still grow into a stop string."""
        text = self.output_text
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - self._sent), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def get_delta(self) -> str:
        """Text not yet returned that can no longer change or turn into a stop string."""
        end = len(self.output_text)
        if not self.finished:
            end -= self._held_back()
        delta = self.output_text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta
