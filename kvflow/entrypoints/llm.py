"""LLM: offline batch generation, vLLM-style."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvflow.engine.llm_engine import LLMEngine
from kvflow.lora_request import LoRARequest
from kvflow.multimodal.inputs import ImageItem, MultiModalData
from kvflow.multimodal.media import MediaConnector
from kvflow.multimodal.parts import ImageRef, conversation_images
from kvflow.options import engine_config
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import render_chat

# a text, token ids, or vLLM's dict: {"prompt": text} or {"prompt_token_ids": ids}, with
# "multi_modal_data": {"image": image or [images]} (PIL images)
Prompt = str | list[int] | dict
Message = dict


class LLM:
    """Generate offline with continuous batching. `model=None` loads the default
    SmolLM2-135M-Instruct; every other keyword is an engine option (docs/configuration.md's table, or
    `kvflow.options.OPTIONS`), e.g. `dtype`, `max_num_seqs`, `kv_cache_memory`, `seed`,
    `trace=PATH` (one JSON line per engine step), `tensor_parallel_size=N` (this process is
    rank 0; `llm.engine.shutdown()` stops the others). An unknown keyword is a TypeError naming
    the closest valid one."""

    def __init__(self, model: str | None = None, **options) -> None:
        config = engine_config(model=model, **options)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.media = MediaConnector.of(config.multimodal_config)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None,
                 prompt_texts: Sequence[str] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's dict with `prompt` or
        `prompt_token_ids` and `multi_modal_data={"image": [...]}`: PIL images, for a model
        that takes images); outputs come back in input order. `priority` (lower first)
        applies with scheduling_policy="priority"; requests with different `cache_salt` never
        share prefix-cache blocks. `lora_request`: the LoRA
        adapter all prompts run under, or one per prompt (None: the base model); needs
        enable_lora, and an adapter is loaded on its first use."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        loras = self._loras(lora_request, len(prompts))
        mm_data = [self._multi_modal_data(p, i) for i, p in enumerate(prompts)]
        encoded = [self._encode(p) for p in prompts]
        if prompt_texts is not None:
            encoded = [(text, ids) for text, (_, ids) in zip(prompt_texts, encoded)]
        check = self.engine.input_processor
        features = []  # each prompt's images, processed once: (expanded ids, features) or None
        for (_, ids), p, lr, (mm, names) in zip(encoded, params, loras, mm_data):
            expanded = None
            if mm:  # the part named first, then checked once expanded for its images
                check.check_multi_modal(mm, names)
                expanded = self.engine.process_images(ids, mm)
                ids = expanded[0]
            check.process(ids, p, lr, mm, names)  # every prompt, before any is queued
            features.append(expanded)
        order = {}
        for (text, ids), p, prio, lr, expanded in zip(encoded, params, priority, loras, features):
            rid = str(next(self._ids))
            order[rid] = len(order)
            ids, mm_features = expanded if expanded is not None else (ids, None)
            self.engine.add_request(rid, ids, p, prompt=text, priority=prio, cache_salt=cache_salt,
                                    lora_request=lr, checked=True, mm_features=mm_features)
        return self._run(order, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in input order: the final hidden
        states pooled as the engine's `pooler_config` says (default: the last token's,
        normalized); `pooling_params` may override `normalize` per prompt. The prompts run
        through the same scheduler as generation, prefill only. `lora_request`: the LoRA
        adapter all prompts run under, or one per prompt, as in `generate`."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = ([pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams)
                  else list(pooling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} pooling params")
        loras = self._loras(lora_request, len(prompts))
        for i, p in enumerate(prompts):
            if isinstance(p, dict) and p.get("multi_modal_data"):
                raise ValueError(f"prompts[{i}].multi_modal_data: embeddings of images are not "
                                 "implemented; embed text")
        encoded = [self._encode(p) for p in prompts]
        check = self.engine.input_processor
        for (_, ids), p, lr in zip(encoded, params, loras):
            check.process_pooling(ids, p, lr)  # every prompt, before any is queued
        order = {}
        for (text, ids), p, lr in zip(encoded, params, loras):
            rid = str(next(self._ids))
            order[rid] = len(order)
            self.engine.add_pooling_request(rid, ids, p, prompt=text, checked=True,
                                            lora_request=lr)
        return self._run(order, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Chat through the model's chat template; one conversation or a list of them. A
        message's content may be a list of OpenAI's parts: `text`, `image_url` (a `data:` URL,
        `file://` under allowed_local_media_path, `http(s)://` from allowed_media_domains) or
        vLLM's `image_pil` (a PIL image), for a model that takes images (ValueError naming the
        part otherwise). `chat_template_kwargs`: variables the template reads (e.g.
        `enable_thinking`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered, mm_data = [], []
        for c, convo in enumerate(conversations):
            where = "messages" if len(conversations) == 1 else f"messages[{c}]"
            convo, refs = conversation_images(convo, where)
            mm, names = self._load_images(refs)
            # a model that takes no images refuses them before its template sees their parts
            self.engine.input_processor.check_multi_modal(mm, names)
            mm_data.append((mm, names))
            rendered.append(render_chat(self.tokenizer, convo, add_generation_prompt,
                                        chat_template_kwargs=chat_template_kwargs))
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": mm}
                   for (_, ids), (mm, _) in zip(rendered, mm_data)]
        return self.generate(prompts, sampling_params, use_tqdm,
                             prompt_texts=[text for text, _ in rendered], lora_request=lora_request)

    def _load_images(self, refs: list[ImageRef]) -> tuple[MultiModalData | None, list[str] | None]:
        """The images of one prompt, counted before any is read, each read and bounded."""
        if not refs:
            return None, None
        names = [r.where for r in refs]
        self.engine.input_processor.check_image_count(names)
        items = [self.media.check_image(r.image, r.where) if r.url is None
                 else self.media.load_url(r.url, r.where) for r in refs]
        return {"image": items}, names

    def _multi_modal_data(self, prompt: Prompt, i: int
                          ) -> tuple[MultiModalData | None, list[str] | None]:
        """A dict prompt's `multi_modal_data` as ImageItems (PIL images checked and hashed)."""
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return None, None
        mm = prompt["multi_modal_data"]
        if not isinstance(mm, dict):
            raise ValueError(f"prompts[{i}].multi_modal_data: a dict such as {{'image': [...]}}")
        for key in set(mm) - {"image"}:
            raise ValueError(f"prompts[{i}].multi_modal_data: {key!r} is not a modality kvflow "
                             "takes (only 'image')")
        images = mm.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        names = [f"prompts[{i}].multi_modal_data.image[{k}]" for k in range(len(images))]
        self.engine.input_processor.check_image_count(names)
        items = [img if isinstance(img, ImageItem) else self.media.check_image(img, name)
                 for img, name in zip(images, names)]
        return {"image": items}, names

    def _loras(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each loaded (so checked) before any is queued."""
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * n)
        if len(loras) != n:
            raise ValueError(f"got {n} prompts but {len(loras)} lora requests")
        for lr in dict.fromkeys(lr for lr in loras if lr is not None):
            self.engine.add_lora(lr)
        return loras

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a dict prompt has `prompt` (text) or `prompt_token_ids`, and "
                                 f"optionally `multi_modal_data`; got keys {sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            return prompt, ids
        return None, list(prompt)

    def reset_prefix_cache(self) -> bool:
        return self.engine.core.reset_prefix_cache()

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list:
        results: list = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        n_in = n_out = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[order[out.request_id]] = out
                    n_in += len(out.prompt_token_ids)
                    if isinstance(out, RequestOutput):
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"input: {n_in / elapsed:.0f} tok/s, "
                                        f"output: {n_out / elapsed:.0f} tok/s", refresh=False)
                    bar.update(1)
        bar.close()
        return results

