"""The one request check: everything a request asks for is checked here, once, where it enters
the engine (vLLM's `InputProcessor`). `LLM`, the sync engine, the async engine and the OpenAI
server all call it; the engine core behind it only asserts what it made true.

A refusal is a ValueError whose message starts with the field to change (an
`InvalidRequestError` carries that field as `param`), so that the server turns it into a 400
naming the field. What a request may ask for depends on the model and the options only, which
the frontend knows once the core is ready (`RequestLimits`), so no check waits for the core.

Two kinds of check stay behind, on state that only the core holds: `kv_transfer_params` on an
engine with a KV connector (kvflow/kv_transfer/pd_connector.py compares them with its role and
this engine's cache, and a refusal there releases the producer's lease at once) and the block
count of a model with several KV cache groups (the scheduler's KV cache coordinator).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import EngineConfig
from kvflow.kv_transfer.params import check_role
from kvflow.lora_request import LoRARequest
from kvflow.multimodal.inputs import ImageItem, MultiModalData
from kvflow.pooling_params import PoolingParams
from kvflow.request import InvalidRequestError, check_request_fits
from kvflow.sampling_params import SamplingParams, check_token_ids
from kvflow.structured import validate_structured_outputs


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the loaded model and its KV cache allow one request: known once the core is ready
    (EngineCoreReady carries the same four numbers to the frontend)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    supports_images: bool = False  # the loaded model takes images

    @classmethod
    def of(cls, ready) -> "RequestLimits":
        """The limits an EngineCoreReady (or anything with these fields) reports."""
        return cls(ready.vocab_size, ready.max_model_len, ready.block_size, ready.num_blocks,
                   getattr(ready, "supports_images", False))


class InputProcessor:
    """Checks a request against the engine's options and limits before anything is queued.

    `process` / `process_pooling` are the whole check. The server runs the same checks in
    three stages (`check_params` before it tokenizes, `check_constraint` off the event loop for
    a big schema, `check_prompt` per prompt), so that every prompt of a request is refused
    before any is queued; each check still runs once per request."""

    def __init__(self, config: EngineConfig, limits: RequestLimits) -> None:
        self.config = config
        self.limits = limits

    # -- the whole check --------------------------------------------------------------------
    def process(self, prompt_token_ids: list[int], params: SamplingParams,
                lora_request: LoRARequest | None = None,
                multi_modal_data: MultiModalData | None = None,
                image_names: list[str] | None = None) -> None:
        """ValueError naming the field if this generation request can never run here
        (`image_names`: where each image came from, for the messages; default
        `multi_modal_data.image[i]`)."""
        check_token_ids("prompt", prompt_token_ids, self.limits.vocab_size)
        self.check_multi_modal(multi_modal_data, image_names)
        self.check_params(params, lora_request)
        self.check_constraint(params)
        self.check_fits(prompt_token_ids, params)

    def process_pooling(self, prompt_token_ids: list[int], params: PoolingParams | None = None,
                        lora_request: LoRARequest | None = None, name: str = "prompt") -> None:
        """ValueError if this embedding request (prefill only) can never run here; `name` is
        the API's field for the prompt (the embeddings endpoint calls it `input`)."""
        if lora_request is not None and not self.config.lora_config.enable_lora:
            raise InvalidRequestError(f"model {lora_request.lora_name!r} is a LoRA adapter: the "
                                      "engine serves adapters only with enable_lora "
                                      "(--enable-lora)", "model")
        lim = self.limits
        check_token_ids(name, prompt_token_ids, lim.vocab_size)
        check_request_fits(len(prompt_token_ids), 0, lim.max_model_len, lim.block_size,
                           lim.num_blocks)

    # -- the stages -------------------------------------------------------------------------
    def check_params(self, params: SamplingParams, lora_request: LoRARequest | None = None) -> None:
        """What the sampling params ask of this engine, the prompt aside: every id and top_k
        within the vocabulary, prompt logprobs where they can be computed, a constraint where
        it can be enforced, an adapter where adapters are served. The constraint's own text is
        `check_constraint`'s."""
        params.verify_token_ids(self.limits.vocab_size)
        if params.prompt_logprobs is not None:
            self.check_prompt_logprobs(params)
        if params.kv_transfer_params is not None and self.config.kv_transfer is None:
            # no KV connector in this engine: nothing there could take it (with one, the
            # connector checks it against its role and cache, and releases a refused lease)
            check_role(None, params.kv_transfer_params)
        if lora_request is not None and not self.config.lora_config.enable_lora:
            raise ValueError(f"model {lora_request.lora_name!r} is a LoRA adapter: the engine "
                             f"serves adapters only with enable_lora (--enable-lora)")

    def check_image_count(self, names: list[str]) -> None:
        """At most limit_mm_per_prompt images, checked before any is read or decoded; the
        refusal names the first image over the limit."""
        limit = self.config.multimodal_config.limit("image")
        if len(names) > limit:
            at = names[limit]
            raise InvalidRequestError(f"{at}: {len(names)} images in one prompt; at most {limit} "
                                      "(limit_mm_per_prompt, --limit-mm-per-prompt)", at)

    def check_multi_modal(self, multi_modal_data: MultiModalData | None,
                          image_names: list[str] | None = None) -> None:
        """Images only for a model that takes them, at most limit_mm_per_prompt of them, each
        an ImageItem (read and bounded by kvflow/multimodal/media.py). The refusal names the
        part (`image_names[i]`)."""
        if not multi_modal_data:
            return
        if not isinstance(multi_modal_data, dict):
            raise InvalidRequestError("multi_modal_data: a dict of modality -> items, e.g. "
                                      '{"image": [...]}', "multi_modal_data")
        for key in multi_modal_data:
            if key != "image":
                raise InvalidRequestError(f"multi_modal_data.{str(key)[:32]}: kvflow takes images "
                                          "only", "multi_modal_data")
        images = multi_modal_data.get("image") or []
        names = image_names or [f"multi_modal_data.image[{i}]" for i in range(len(images))]
        if len(names) != len(images):
            raise ValueError(f"{len(images)} images but {len(names)} names for them")
        for name, item in zip(names, images):
            if not isinstance(item, ImageItem):
                raise InvalidRequestError(f"{name}: expected an ImageItem (a decoded image), got "
                                          f"{type(item).__name__}", name)
        self.check_image_count(names)
        if images and not self.limits.supports_images:
            raise InvalidRequestError(f"{names[0]}: the loaded model takes no images (it is a "
                                      "text-only model); send text only", names[0])

    def check_prompt_logprobs(self, params: SamplingParams) -> None:
        """InvalidRequestError for prompt_logprobs where they cannot be computed correctly: with
        speculative decoding (a draft model keeps its own prefix state; not verified together),
        and with KV transfer (a pulled prompt is never computed here)."""
        if self.config.speculative_config is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with speculative decoding "
                                      "(speculative_config); leave it out", "prompt_logprobs")
        if params.kv_transfer_params is not None:
            raise InvalidRequestError("prompt_logprobs cannot be combined with kv_transfer_params",
                                      "prompt_logprobs")

    def check_constraint(self, params: SamplingParams) -> None:
        """A constraint the grammar backend cannot enforce (a bad schema, grammar or regex) is
        refused naming the problem, never served as unconstrained output. It compiles the
        constraint, so the server runs it off the event loop for a big one."""
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs,
                                        self.config.structured_outputs_backend)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams,
                     multi_modal_data: MultiModalData | None = None,
                     image_names: list[str] | None = None) -> None:
        """The prompt's ids within the vocabulary, its images (`check_multi_modal`), then
        `check_fits`."""
        check_token_ids("prompt", prompt_token_ids, self.limits.vocab_size)
        self.check_multi_modal(multi_modal_data, image_names)
        self.check_fits(prompt_token_ids, params)

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """InvalidRequestError unless prompt + max_tokens fits in max_model_len and in the KV
        pool, and min_tokens in the max_tokens it gets."""
        lim = self.limits
        check_request_fits(len(prompt_token_ids), params.max_tokens, lim.max_model_len,
                           lim.block_size, lim.num_blocks, params.min_tokens)

    def check_mm_features(self, prompt_len: int, features) -> None:
        """Processed images (request.MultiModalFeatureSpec) a core request carries: a model
        that takes images, placeholder runs in order inside the prompt, pixel values that fill
        their shape (float32)."""
        if not self.limits.supports_images:
            raise InvalidRequestError("multi_modal_data: this model does not take images",
                                      "multi_modal_data")
        end = 0
        for f in features:
            if f.offset < end or f.length <= 0 or f.end > prompt_len:
                raise InvalidRequestError("multi_modal_data: image placeholder runs must lie in "
                                          "the prompt, in order, without overlapping",
                                          "multi_modal_data")
            n = 4
            for d in f.shape:
                n *= d
            if not f.shape or n != len(f.data):
                raise InvalidRequestError("multi_modal_data: an image's pixel values do not fill "
                                          f"its shape {tuple(f.shape)}", "multi_modal_data")
            end = f.end

    # -- the core's door --------------------------------------------------------------------
    def process_core_request(self, r) -> None:
        """The whole check of an EngineCoreRequest handed to the core by a caller that did not
        go through a frontend (its `checked` is False)."""
        check_token_ids("eos_token_ids", r.eos_token_ids, self.limits.vocab_size)
        if r.mm_features:
            self.check_mm_features(len(r.prompt_token_ids), r.mm_features)
        if r.pooling_params is not None:
            self.process_pooling(r.prompt_token_ids, r.pooling_params, r.lora_request)
        else:
            self.process(r.prompt_token_ids, r.sampling_params, r.lora_request)
