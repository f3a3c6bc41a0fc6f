"""OutputProcessor: turns the core's token deltas into RequestOutputs. It detokenizes
incrementally, ends requests on stop strings, and fans `n` samples out and back in."""
from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, replace

from kvflow.engine.detokenizer import IncrementalDetokenizer, StopStrings, decode_token
from kvflow.engine.protocol import EngineCoreOutput, EngineCoreRequest
from kvflow.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                            PromptLogprobs, PromptLogprobsChunk, RequestOutput, TokenLogprobs,
                            embedding_from_bytes)
from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    FINAL = 0       # one RequestOutput when every sample has finished
    DELTA = 1       # each RequestOutput carries only what is new since the last one
    CUMULATIVE = 2  # each RequestOutput carries everything so far


@dataclass
class SampleState:
    """One of the `n` samples of a request (one request in the core)."""

    core_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    finish_sent: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    kind: OutputKind
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    # with prompt_logprobs: the prompt's positions scored so far (sample 0 scores them)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    pooled: bytes | None = None  # an embedding request's vector, once its prompt is done
    is_pooling: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def take_prompt_logprobs(self, kind: OutputKind, finished: bool) -> PromptLogprobs | None:
        """The prompt logprobs for the output made now: a DELTA stream carries them once, on
        the first output after the prompt is done (or at the end, whatever is there)."""
        lps = self.prompt_logprobs
        if lps is None or (kind == OutputKind.DELTA and self.prompt_logprobs_sent):
            return None
        if len(lps) < len(self.prompt_token_ids) and not finished:
            return None
        self.prompt_logprobs_sent = True
        return lps


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.core_to_sample: dict[str, tuple[RequestState, SampleState]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, kind: OutputKind = OutputKind.FINAL,
                    eos_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request=None, checked: bool = False) -> list[EngineCoreRequest]:
        """Register a request; returns the core requests to send (one per sample), marked
        `checked` when the input processor has passed it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time or time.time()
        state = RequestState(request_id, prompt, list(prompt_token_ids), [], kind, arrival)
        core_reqs = []
        stops = StopStrings(list(params.stop or []))  # indexed once for all n samples
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first position has no logprob
        try:
            for i in range(params.n):
                core_id = request_id if params.n == 1 else f"{request_id}#{i}"
                p = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + i
                    # one sample scores the prompt; the others may take prefix-cache hits
                    p = replace(params, n=1, seed=seed,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p, stops)
                sample = SampleState(core_id, i, detok, p)
                if p.logprobs is not None:
                    sample.logprobs, sample.cumulative_logprob = [], 0.0
                state.samples.append(sample)
                self.core_to_sample[core_id] = (state, sample)
                core_reqs.append(EngineCoreRequest(core_id, list(prompt_token_ids), p, eos_token_ids,
                                                   arrival, priority, cache_salt,
                                                   lora_request=lora_request, checked=checked))
        except BaseException:
            for sample in state.samples:  # all or nothing: no half-registered request
                self.core_to_sample.pop(sample.core_id, None)
            raise
        self.requests[request_id] = state
        return core_reqs

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            params: PoolingParams, arrival_time: float | None = None,
                            priority: int = 0, checked: bool = False,
                            lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Register an embedding request; returns the core request to send."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time or time.time()
        state = RequestState(request_id, prompt, list(prompt_token_ids), [], OutputKind.FINAL,
                             arrival, is_pooling=True)
        sample = SampleState(request_id, 0, None, SamplingParams())
        state.samples.append(sample)
        self.requests[request_id] = state
        self.core_to_sample[request_id] = (state, sample)
        return EngineCoreRequest(request_id, list(prompt_token_ids), SamplingParams(),
                                 arrival_time=arrival, priority=priority, pooling_params=params,
                                 lora_request=lora_request, checked=checked)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the core ids still to abort in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = []
        for s in state.samples:
            self.core_to_sample.pop(s.core_id, None)
            if s.finish_reason is None:
                ids.append(s.core_id)
        return ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs to hand out and the core ids
        that a stop string ended (the caller aborts them in the core)."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.core_to_sample.get(out.request_id)
            if entry is None:
                continue  # aborted by the user while the step ran
            state, sample = entry
            if out.first_scheduled_time and state.first_scheduled_time is None:
                state.first_scheduled_time = out.first_scheduled_time
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = {k: v for k, v in asdict(out.kv_transfer_params).items()
                                            if v is not None and v is not False}
            finished = out.finish_reason is not None
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state.prompt_logprobs, out.prompt_logprobs)
            if state.is_pooling:
                if finished:
                    state.pooled = out.pooled
                    sample.finish_reason = out.finish_reason
                    self.core_to_sample.pop(sample.core_id, None)
                    touched[state.request_id] = state
                continue
            if not out.new_token_ids and not finished:
                continue  # a prompt chunk's logprobs only: they go out with the first token
            new = out.new_token_ids
            if len(new) > 1:
                # several tokens in one step (speculative decoding): each goes in alone, as it
                # would without speculation, and a stop string ends the output at its token
                for i, token in enumerate(new):
                    stop_str = sample.detokenizer.update([token], finished and i == len(new) - 1)
                    if stop_str is not None:
                        new = new[:i + 1]
                        break
            else:
                stop_str = sample.detokenizer.update(new, finished)
            sample.token_ids.extend(new)
            if out.new_logprobs and sample.logprobs is not None:
                for lp in out.new_logprobs[:len(new)]:
                    sample.logprobs.append(self._logprob_dict(lp))
                    sample.cumulative_logprob += lp.logprobs[0]
            if stop_str is not None and not finished:
                to_abort.append(sample.core_id)
                finished = True
            if stop_str is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop_str
            elif finished:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if finished:
                self.core_to_sample.pop(sample.core_id, None)
            touched[state.request_id] = state

        results = []
        for state in touched.values():
            done = state.finished
            if done:
                del self.requests[state.request_id]
            if state.kind == OutputKind.FINAL and not done:
                continue
            results.append(self._make_embedding(state) if state.is_pooling
                           else self._make_output(state, done))
        return results, to_abort

    def _add_prompt_logprobs(self, into: PromptLogprobs, chunk: PromptLogprobsChunk) -> None:
        """Append the chunk's positions not already there (a recomputed prompt repeats them)."""
        skip = len(into) - chunk.start
        if skip < 0:  # a gap cannot happen: chunks come in order
            raise AssertionError(f"prompt logprobs from position {chunk.start}, have {len(into)}")
        for lp in chunk.entries[skip:]:
            into.append(self._logprob_dict(lp))

    @staticmethod
    def _make_embedding(state: RequestState) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(state.request_id, EmbeddingOutput(
            embedding_from_bytes(state.pooled)), state.prompt_token_ids, True, state.prompt)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for rank, (tok, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tok not in d:
                d[tok] = Logprob(value, lp.sampled_rank if rank == 0 else rank,
                                 decode_token(self.tokenizer, tok))
        return d

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        completions = []
        for s in state.samples:
            if state.kind == OutputKind.DELTA:
                start = s.num_sent_tokens
                text = s.detokenizer.get_delta()
                if not text and start == len(s.token_ids) and (s.finish_reason is None or s.finish_sent):
                    continue  # nothing new for this sample
                s.finish_sent = s.finish_reason is not None
                completions.append(CompletionOutput(
                    s.index, text, s.token_ids[start:], s.cumulative_logprob,
                    s.logprobs[start:] if s.logprobs is not None else None,
                    s.finish_reason, s.stop_reason))
                s.num_sent_tokens = len(s.token_ids)
            else:
                completions.append(CompletionOutput(
                    s.index, s.detokenizer.output_text, list(s.token_ids), s.cumulative_logprob,
                    s.logprobs, s.finish_reason, s.stop_reason))
        metrics = {"arrival_time": state.arrival_time,
                   "first_scheduled_time": state.first_scheduled_time,
                   "first_token_time": state.first_token_time}
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, num_cached_tokens=state.num_cached_tokens, metrics=metrics,
                             kv_transfer_params=state.kv_transfer_params if finished else None,
                             prompt_logprobs=state.take_prompt_logprobs(state.kind, finished))
