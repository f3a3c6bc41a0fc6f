"""ModelRunner: SchedulerOutput -> flat batch tensors -> one forward -> sampled token ids."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.core.kv_cache.groups import layer_pages, layer_slots
from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.model import hugepages
from kvflow.model.arch import LlamaArchConfig
from kvflow.attention.bidirectional import BidirectionalRun
from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_group_kv_caches, kv_cache_groups
from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.model.key_scales import set_key_scales
from kvflow.model.malloc_tuning import retain_freed_memory
from kvflow.model.pooler import PoolingState, prompt_logprobs_chunk
from kvflow.model.rejection_sampler import greedy_accept, rejection_sample
from kvflow.model.sampler import (Sampler, SamplingRow, apply_grammar_bitmask,
                                  build_sampling_metadata, logit_bias_tensors)
from kvflow.outputs import PromptLogprobsChunk, TokenLogprobs
from kvflow.request import eos_ids
from kvflow.sampling_params import SamplingParams
from kvflow import envs


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    plain_greedy: bool = False  # argmax is all its sampling needs (no penalties, bans, logprobs)
    needs_history: bool = False  # penalties / min_tokens read its prompt and output tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # made once, used every step
    pooling: PoolingState | None = None  # an embedding request: pooled, never sampled
    prompt_logprobs: int | None = None  # top-N of each prompt position, while its prompt runs
    mm_features: list = field(default_factory=list)  # its images (request.MultiModalFeatureSpec)

    @property
    def reads_prompt_rows(self) -> bool:
        return self.pooling is not None or self.prompt_logprobs is not None
    lora_int_id: int = 0  # its adapter (model/lora.py); 0: the base model


def _needs_history(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.min_tokens > 0)


@dataclass
class ModelRunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted ones and the target's
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per new token
    # embedding requests whose prompt finished this step: the pooled vector, float32 bytes
    pooled: dict[str, bytes] = field(default_factory=dict)
    # requests with prompt_logprobs: what this step's chunk of their prompt scored
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


def longest_position(arch: LlamaArchConfig, max_model_len: int, num_blocks: int,
                     block_size: int) -> int:
    """How many positions the RoPE tables must hold: the longest sequence admitted
    (max_model_len, else the model's context), and no more than the cache can hold where every
    layer keeps all its keys (behind sliding windows a sequence can outgrow the cache)."""
    longest = max_model_len or arch.max_position_embeddings
    if all(w is None for w in arch.layer_windows()):
        longest = min(longest, num_blocks * block_size)
    return longest


class ModelRunner:
    """Keeps a persistent per-request state, builds the flattened batch of each step with numpy,
    runs the model once, and samples only where a request's known tokens are all computed."""

    def __init__(self, model: torch.nn.Module, arch: LlamaArchConfig, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype,
                 eos_token_id: int | Sequence[int] | None, *, device: torch.device | str = "cpu",
                 graphs: DecodeGraphs | None = None, kv_memory=None, pp=None,
                 max_model_len: int = 0, num_state_slots: int = 0,
                 model_kv_windows: tuple | None = None, first_layer: int = 0) -> None:
        # kv_memory: where the CPU KV cache lives (allocate_kv_caches's `zeros`); a shared file
        # when the tensor-parallel driver moves this rank's blocks (distributed/shared_kv.py)
        # pp: this rank's pipeline stage (kvflow.distributed.pipeline.PipelineGroup): a stage
        # other than the first receives the previous one's hidden states instead of embedding
        # the tokens, one other than the last sends its own on and samples nothing.
        # model_kv_windows, first_layer: a pipeline stage's place in the whole model (every
        # layer's window, and its first layer's index): the KV cache groups are the whole
        # model's, as the scheduler's block tables are; the stage holds its layers' tensors
        self.model = model
        self.pp = pp
        self.arch = arch
        self.first_layer = first_layer
        self.block_size = block_size
        self.eos_token_ids = eos_ids(eos_token_id)  # the model's, all of them
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        # KV cache groups (core/kv_cache/groups.py) of the layers that hold a KV cache: one
        # group of them all without windows; with windows, or layers of different shapes, one
        # group per kind, layer j of each group in shared tensor j (a layer whose page is a
        # k-th of the largest: k of them per tensor, each with its own metadata). A hybrid
        # model's state layers hold none: they read the step's metadata for the requests'
        # state slots (the scheduler's last group: one slot each).
        kv_layers = arch.attention_layers()
        if model_kv_windows is not None and len(kv_layers) != arch.num_hidden_layers:
            raise ValueError("a pipeline stage of a model with state layers is not supported")
        self.groups = kv_cache_groups(arch, kv_dtype, model_kv_windows)
        if not on_cpu and any(g.sliding_window is not None for g in self.groups):
            raise ValueError("sliding-window attention runs on the CPU only for now "
                             "(the GPU kernels take no window)")
        num_kv = sum(len(g.layers) for g in self.groups)
        group_of, _ = layer_slots(self.groups, num_kv)
        page_of = layer_pages(self.groups, num_kv)
        # one metadata per group and place in its tensors' pages; each group's first one's index
        first_meta = np.cumsum([0] + [g.pages_per_slot for g in self.groups]).tolist()
        self.meta_pages = [g.pages_per_slot for g in self.groups for _ in range(g.pages_per_slot)]
        self.state_group = len(self.groups) if num_state_slots else None
        if num_state_slots:
            model.allocate_state(num_state_slots)
        # each model layer's metadata (a state layer: group 0's, which has every request)
        local = range(first_layer, first_layer + len(kv_layers))
        self.layer_meta = [0] * arch.num_hidden_layers
        for j, i in enumerate(kv_layers):
            self.layer_meta[i] = first_meta[group_of[local[j]]] + page_of[local[j]]
        if hasattr(model, "cover_positions"):  # max_model_len 0: the model's context
            model.cover_positions(longest_position(arch, max_model_len, num_blocks, block_size))
        if pp is None:  # before the cache: its calibration run needs the memory for a moment
            set_key_scales(model, arch, kv_dtype)
        views, tensors = allocate_group_kv_caches(self.groups, list(local), num_blocks, block_size,
                                                  kv_dtype, None if on_cpu else self.device,
                                                  zeros=kv_memory)
        self.kv_caches = [None] * arch.num_hidden_layers
        for j, i in enumerate(kv_layers):
            self.kv_caches[i] = views[j]
        model.kernels = model.kernels.with_kv_dtype(kv_dtype)  # attention chosen for this cache
        self._block_bytes = tensors[0][0].numel() * tensors[0][0].element_size() // num_blocks
        # the cache's pages are faulted in ahead of the writes (KVFLOW_KV_POPULATE=0: on first write)
        self.populator = (hugepages.Populator([t for pair in tensors for t in pair])
                          if envs.KVFLOW_KV_POPULATE and on_cpu else None)
        if on_cpu:
            retain_freed_memory()  # after the KV cache: only the per-step activations are affected
        self.graphs = graphs  # decode steps through CUDA graphs (cuda_graphs.py); None: eager
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self._num_reading_prompt_rows = 0  # requests pooling or scoring their prompt
        self.lora = None  # LoRAManager (model/lora.py) once enable_lora(...)

    def _state_slots(self, out: SchedulerOutput, req_ids: list[str]) -> tuple[np.ndarray, dict]:
        """Each request's state slot (a step built without groups, the warm-up's: slot 0, whose
        state a request's first token resets), and the snapshots this step takes: request's
        row -> (the offset in its chunk of the token after which, the snapshot's slot)."""
        g = self.state_group
        slots = np.fromiter((t[g][0] if (t := out.group_block_ids.get(r)) else 0 for r in req_ids),
                            dtype=np.int64, count=len(req_ids))
        saves = {}
        if out.state_saves:
            row = {r: i for i, r in enumerate(req_ids)}
            for rid, position, snap in out.state_saves:
                saves[row[rid]] = (position - out.num_computed_tokens[rid] - 1, snap)
        return slots, saves

    def _drop(self, rid: str) -> CachedRequestState | None:
        state = self.requests.pop(rid, None)
        if state is not None and state.reads_prompt_rows:
            self._num_reading_prompt_rows -= 1
        return state

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Give the model `max_loras` adapter slots of `max_lora_rank` (ValueError where
        adapters cannot be served: other architectures). Under tensor or pipeline parallelism
        every rank does, and holds its part of each adapter."""
        from kvflow.model.lora import LoRAManager

        self.lora = LoRAManager(self.model, self.arch, max_loras, max_lora_rank, self.first_layer)

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._drop(rid)
        for rid in out.preempted_req_ids:
            self._drop(rid)
        for new in out.scheduled_new_reqs:
            old = self._drop(new.req_id)
            gen = old.generator if old is not None else None
            if gen is None and new.sampling_params.seed is not None:
                gen = torch.Generator().manual_seed(new.sampling_params.seed)
            p = new.sampling_params
            history = _needs_history(p)
            pp = new.pooling_params
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, p, gen,
                plain_greedy=p.greedy and not history and p.logprobs is None and not p.logit_bias,
                needs_history=history, logit_bias=logit_bias_tensors(p),
                pooling=PoolingState(pp.pooling_type, pp.normalize) if pp is not None else None,
                # resumed with outputs: its prompt's logprobs were all sent before
                prompt_logprobs=(p.prompt_logprobs if pp is None
                                 and len(new.token_ids) == new.num_prompt_tokens else None),
                lora_int_id=new.lora_int_id, mm_features=list(new.mm_features))
            if state.reads_prompt_rows:
                self._num_reading_prompt_rows += 1

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Tokens the driver sampled last step, on a tensor-parallel rank that does not sample
        (the driver's runner appends its own in `execute`); unknown ids are gone already."""
        reqs = self.requests
        for rid, tokens in sampled.items():
            state = reqs.get(rid)
            if state is not None:
                state.token_ids.extend(tokens)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        """One step. `grammar` (the engine's GrammarBitmask: `req_ids` and an int32 `bitmask`,
        one row each) masks the logits of the constrained rows that sample; None when no row
        of this step is constrained, so unconstrained batches pay nothing."""
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids = list(out.num_scheduled_tokens)
        n = len(req_ids)
        states = [self.requests[rid] for rid in req_ids]
        query_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=n)
        starts = np.fromiter(map(out.num_computed_tokens.__getitem__, req_ids), dtype=np.int64, count=n)
        seq_lens = starts + query_lens
        num_known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=n)
        spec = out.scheduled_spec_decode_tokens
        num_spec = (np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=n)
                    if spec else 0)
        # requests whose known tokens are all in (their drafts come after them)
        rows = np.flatnonzero(seq_lens - num_spec == num_known)

        # Per request O(1) work for decodes; prompt chunks copy their own tokens only.
        if out.total_num_scheduled_tokens == n:
            input_ids = [s.token_ids[i] for s, i in zip(states, starts.tolist())]
        else:
            input_ids = []
            for s, start, end in zip(states, starts.tolist(), seq_lens.tolist()):
                input_ids.extend(s.token_ids[start:end])
                if spec and s.req_id in spec:  # the drafts follow its known tokens
                    input_ids.extend(spec[s.req_id])
        # a verification step (each request its known token and its drafts) on the CPU: every
        # token a decode row, so the one-call decode step takes it as it takes plain decodes
        as_decodes = bool(spec) and self.device.type == "cpu" and bool((query_lens == num_spec + 1).all())
        if len(self.groups) == 1:
            meta = build_attention_metadata(query_lens, seq_lens, [out.block_ids[r] for r in req_ids],
                                            self.block_size, sliding_window=self.groups[0].sliding_window,
                                            queries_as_decodes=as_decodes)
            metas = [meta]
            if self.state_group is not None:
                meta.state_slots, meta.state_saves = self._state_slots(out, req_ids)
        else:  # one metadata per group (its block tables and window) and page, handed to its layers
            # (a step built without groups, the warm-up's, gives every group its one table)
            tables = [out.group_block_ids.get(r) or (out.block_ids[r],) * len(self.groups)
                      for r in req_ids]
            metas = []
            for g, group in enumerate(self.groups):
                k = group.pages_per_slot
                group_tables = [t[g] for t in tables]
                for page in range(k):  # k layers to a page: block b is page k * b + the layer's place
                    metas.append(build_attention_metadata(
                        query_lens, seq_lens,
                        group_tables if k == 1 else [np.asarray(t, dtype=np.int64) * k + page for t in group_tables],
                        self.block_size, sliding_window=group.sliding_window,
                        queries_as_decodes=as_decodes))
            meta = metas[0]
            if self.state_group is not None:
                meta.state_slots, meta.state_saves = self._state_slots(out, req_ids)
        if self.device.type != "cpu":  # the GPU kernels read these (and meta.gpu's arrays) only
            for m in metas:
                m.slot_mapping = m.slot_mapping.to(self.device, non_blocking=True)
                m.device_positions = torch.from_numpy(m.positions).to(self.device, non_blocking=True)
        if self.populator is not None:  # every cache's bytes up to the furthest block written
            last = max(int(m.slot_mapping.max()) // self.block_size // k
                       for m, k in zip(metas, self.meta_pages))
            self.populator.need((last + 1) * self._block_bytes)
        # the rows of adapters: their slots (None: every row is the base model's)
        lora = (self.lora.step([s.lora_int_id for s in states], query_lens)
                if self.lora is not None else None)
        graphs = self.graphs
        if (graphs is not None and lora is None and len(metas) == 1
                and out.total_num_scheduled_tokens == n
                and graphs.fits(n, meta.decode_block_tables.shape[1])):
            size, padded = graphs.prepare(meta, input_ids)
            hidden = graphs.run(size, padded, self._forward)[:n]
        else:
            layer_metas = meta if len(metas) == 1 else [metas[m] for m in self.layer_meta]
            if out.state_restores:  # prefix-cache hits resume from state snapshots
                self.model.copy_states(out.state_restores)
            ids = torch.tensor(input_ids, dtype=torch.long).to(self.device)
            embeds = None
            if out.scheduled_encoder_inputs:  # images: their embeddings and bidirectional runs
                embeds = self._place_images(out, ids, states, starts, seq_lens,
                                            meta.query_start_loc, req_ids, metas)
            mrope = None
            if getattr(self.model, "uses_mrope", False):  # each token's (t, h, w) positions
                mrope = np.concatenate([self.model.mrope_positions(s.mm_features, b, e)
                                        for s, b, e in zip(states, starts.tolist(), seq_lens.tolist())],
                                       axis=1)
            hidden = self._forward(ids, layer_metas, lora, embeds, mrope)

        result = ModelRunnerOutput()
        if self.pp is not None and not self.pp.is_last:
            return result  # only the last stage holds the final hidden states
        if self._num_reading_prompt_rows:
            pooling = self._read_prompt_rows(hidden, meta.query_start_loc, states, starts, result)
            if pooling is not None:
                rows = rows[~pooling[rows]]  # an embedding request never samples
        if len(rows) == 0:
            return result
        if spec:
            return self._verify(hidden, meta.query_start_loc, rows, states, spec, grammar)
        # logits only at each sampling request's last position
        sampled_states = [states[i] for i in rows.tolist()]
        greedy = all(s.plain_greedy for s in sampled_states)
        logits = self.model.compute_logits(
            hidden[torch.from_numpy(meta.query_start_loc[rows + 1] - 1).to(self.device)],
            as_float=not greedy or grammar is not None)
        if logits is None:  # a tensor-parallel rank other than the driver: it never samples
            return result
        if grammar is not None:
            row_of = {s.req_id: j for j, s in enumerate(sampled_states)}
            apply_grammar_bitmask(logits, [row_of[rid] for rid in grammar.req_ids],
                                  grammar.bitmask)
        if greedy:
            tokens, logprobs = self.model.kernels.argmax(logits), None
        else:
            meta = build_sampling_metadata([self._sampling_row(s) for s in sampled_states],
                                           logits.shape[-1], logits.device)
            meta.grammar_masked = grammar is not None
            sampled = self.sampler(logits, meta)
            tokens, logprobs = sampled.sampled_token_ids, sampled.logprobs
        for j, (state, token) in enumerate(zip(sampled_states, tokens)):
            state.token_ids.append(token)
            result.sampled[state.req_id] = [token]
            if logprobs is not None and logprobs[j] is not None:
                result.logprobs[state.req_id] = [logprobs[j]]
        return result

    def _read_prompt_rows(self, hidden: torch.Tensor, query_start_loc: np.ndarray,
                          states: list[CachedRequestState], starts: np.ndarray,
                          result: ModelRunnerOutput) -> np.ndarray | None:
        """Pool the embedding requests' rows and score the prompt rows of requests with
        prompt_logprobs, chunk by chunk; returns which of the step's requests pool (None:
        none does)."""
        pooling = None
        for j, s in enumerate(states):
            if not s.reads_prompt_rows:
                continue
            start = int(starts[j])
            if start >= s.num_prompt_tokens:
                s.prompt_logprobs = None  # its prompt is done: only decodes from here
                self._num_reading_prompt_rows -= 1
                continue
            rows = hidden[int(query_start_loc[j]):int(query_start_loc[j + 1])]
            if s.pooling is not None:
                if pooling is None:
                    pooling = np.zeros(len(states), dtype=bool)
                pooling[j] = True
                vec = s.pooling.add(rows, start, s.num_prompt_tokens)
                if vec is not None:
                    result.pooled[s.req_id] = vec
                continue
            chunk = prompt_logprobs_chunk(self.model.compute_logits, rows, s.token_ids, start,
                                          s.num_prompt_tokens, s.prompt_logprobs)
            if chunk is not None:
                result.prompt_logprobs[s.req_id] = chunk
        return pooling

    def _verify(self, hidden: torch.Tensor, query_start_loc: np.ndarray, rows: np.ndarray,
                states: list[CachedRequestState], spec: dict[str, list[int]],
                grammar) -> ModelRunnerOutput:
        """A step with drafts: logits at each sampling request's last 1 + k positions (its
        last known token and its k drafts), checked by rejection sampling."""
        sampled_states = [states[i] for i in rows.tolist()]
        drafts = [spec.get(s.req_id, []) for s in sampled_states]
        ks = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        counts = ks + 1
        first = query_start_loc[rows + 1] - counts  # each request's first row: its known token
        ends = np.cumsum(counts)
        index = np.repeat(first - (ends - counts), counts) + np.arange(int(ends[-1]))
        # plain greedy rows need only the argmax, taken as a plain decode step takes it (the
        # logits in the model's dtype, no fp32 copy, no sampling metadata)
        plain = grammar is None and all(s.plain_greedy for s in sampled_states)
        logits = self.model.compute_logits(hidden[torch.from_numpy(index).to(self.device)],
                                           as_float=not plain)
        if logits is None:  # a tensor-parallel rank other than the driver
            return ModelRunnerOutput()
        if plain:
            result = ModelRunnerOutput()
            for state, new in zip(sampled_states, greedy_accept(self.model.kernels.argmax(logits), drafts)):
                state.token_ids.extend(new)
                result.sampled[state.req_id] = new
            return result
        if grammar is not None:  # each of a constrained request's k + 1 rows has its mask
            first_of = {s.req_id: (int(e - c), int(c))
                        for s, e, c in zip(sampled_states, ends, counts)}
            rows_masked = []
            for rid, n in zip(grammar.req_ids, grammar.num_rows):
                start, c = first_of[rid]
                assert n == c, f"request {rid}: {n} grammar masks for {c} verified rows"
                rows_masked.extend(range(start, start + c))
            apply_grammar_bitmask(logits, rows_masked, grammar.bitmask)
        sampling_rows = []
        for s, d in zip(sampled_states, drafts):
            row = self._sampling_row(s)
            sampling_rows.append(row)
            for i in range(1, len(d) + 1):  # row i follows drafts d[:i]: its history has them
                sampling_rows.append(SamplingRow(
                    row.params, row.prompt_token_ids,
                    row.output_token_ids + d[:i] if s.needs_history else [],
                    row.generator, row.eos_token_ids, row.logit_bias))
        meta = build_sampling_metadata(sampling_rows, logits.shape[-1], logits.device)
        meta.grammar_masked = grammar is not None
        tokens, logprobs = rejection_sample(
            logits, meta, drafts, [s.params.greedy for s in sampled_states],
            [s.generator for s in sampled_states])
        result = ModelRunnerOutput()
        for state, new, lps in zip(sampled_states, tokens, logprobs):
            state.token_ids.extend(new)
            result.sampled[state.req_id] = new
            if lps is not None:
                result.logprobs[state.req_id] = lps
        return result

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graphs of every batch size (start-up, before any request)."""
        if self.graphs is not None:
            self.graphs.capture_all(self._forward, self.block_size)

    def _place_images(self, out: SchedulerOutput, ids: torch.Tensor, states, starts: np.ndarray,
                      seq_lens: np.ndarray, query_start_loc: np.ndarray, req_ids: list[str],
                      metas) -> torch.Tensor:
        """The step's input embeddings with the scheduled images' encoder outputs at their
        placeholder rows; each run's rows computed this step also go to every metadata as a
        bidirectional run (attention/bidirectional.py). An image's encoder output is computed
        once per step however many requests hold it (by content hash), and is consumed in the
        step: the scheduler schedules a placeholder run whole."""
        row_of = {r: i for i, r in enumerate(req_ids)}
        wanted = {}  # content hash -> feature
        for rid, items in out.scheduled_encoder_inputs.items():
            for i in items:
                f = states[row_of[rid]].mm_features[i]
                wanted.setdefault(f.identifier, f)
        outputs = {}
        by_shape: dict[tuple, list] = {}
        for f in wanted.values():
            by_shape.setdefault(tuple(f.shape), []).append(f)
        for shape, feats in by_shape.items():
            pixels = torch.stack([torch.frombuffer(bytearray(f.data), dtype=torch.float32).view(shape)
                                  for f in feats]).to(self.device)
            for f, e in zip(feats, self.model.embed_multimodal(pixels)):
                outputs[f.identifier] = e
        rows, parts, runs = [], [], []
        for rid, items in out.scheduled_encoder_inputs.items():
            b = row_of[rid]
            start, end = int(starts[b]), int(seq_lens[b])
            for i in items:
                f = states[b].mm_features[i]
                first = max(start, f.offset)
                assert f.end <= end, "the scheduler schedules a placeholder run whole"
                row = int(query_start_loc[b]) + first - start
                rows.append(torch.arange(row, row + f.end - first))
                parts.append(outputs[f.identifier][first - f.offset:])
                runs.append(BidirectionalRun(b, row, first, f.end))
        if getattr(self.model, "bidirectional_images", True):
            for m in metas:
                m.bidirectional_runs = runs
        return self.model.embed_input_ids(ids, torch.cat(parts), torch.cat(rows).to(self.device))

    def _forward(self, input_ids: torch.Tensor, meta, lora=None,
                 inputs_embeds: torch.Tensor | None = None,
                 mrope_positions: np.ndarray | None = None) -> torch.Tensor:
        """`meta`: one AttentionMetadata, or one per layer (its KV cache group's); `lora`: the
        step's adapter rows (model/lora.py), if any; `inputs_embeds`: the step's embeddings
        where images were placed in them."""
        positions = (meta[0] if isinstance(meta, list) else meta).positions
        pp = self.pp
        extra = {} if lora is None else {"lora": lora}
        if inputs_embeds is not None:
            extra["inputs_embeds"] = inputs_embeds
        if mrope_positions is not None:
            extra["mrope_positions"] = mrope_positions
        if pp is None:
            return self.model(input_ids, positions, self.kv_caches, meta, **extra)
        hidden = (None if pp.is_first else
                  pp.recv_hidden(input_ids.shape[0], self.arch.hidden_size, self.model.dtype))
        out = self.model(input_ids, positions, self.kv_caches, meta, hidden=hidden, **extra)
        if not pp.is_last:
            pp.send_hidden(out)
        return out

    def _sampling_row(self, s: CachedRequestState) -> SamplingRow:
        # token histories are copied only for requests whose sampling reads them
        if s.needs_history:
            return SamplingRow(s.params, s.token_ids[:s.num_prompt_tokens],
                               s.token_ids[s.num_prompt_tokens:], s.generator, self.eos_token_ids,
                               s.logit_bias)
        return SamplingRow(s.params, [], [], s.generator, self.eos_token_ids, s.logit_bias)
