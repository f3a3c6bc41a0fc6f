"""LLMEngine: the synchronous engine for offline use (EngineCore in-process)."""
from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.engine.core import EngineCore
from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.output_processor import OutputKind, OutputProcessor
from kvflow.lora_request import LoRARequest
from kvflow.multimodal.inputs import MultiModalData
from kvflow.multimodal.processor import multimodal_processor
from kvflow.request import InvalidRequestError
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import get_tokenizer, tokenizer_source


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is served by `kvflow serve` (several "
                             "engine cores behind one API server); offline, run one LLM per "
                             "process")
        self.core = EngineCore(config)
        self.tokenizer = get_tokenizer(tokenizer_source(config.model_config.tokenizer,
                                                        self.core.model_path))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = list(self.core.arch.eos_token_ids)
        # a model that takes images: its processor (expanded prompt ids, pixel values)
        self.mm_processor = (multimodal_processor(self.core.model_path, self.core.arch, self.tokenizer)
                             if self.core.supports_images else None)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def input_processor(self) -> InputProcessor:
        """The one request check (the core's limits and this engine's options)."""
        return self.core.input_processor

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, kind: OutputKind = OutputKind.FINAL,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, checked: bool = False,
                    multi_modal_data: MultiModalData | None = None,
                    mm_features: list | None = None) -> None:
        """Queue a request; ValueError naming the field if the input processor refuses it
        (`checked`: the caller ran `input_processor.process` on it already). With
        `multi_modal_data` ({"image": [ImageItem, ...]}, one per image-start token of the
        prompt, in order) the prompt is expanded by the model's processor first; `mm_features`:
        a prompt the caller expanded already (`process_images`), with its features."""
        features = mm_features
        if multi_modal_data:
            prompt_token_ids, features = self.process_images(prompt_token_ids, multi_modal_data)
            checked = False  # the expanded prompt is checked below
        if not checked:
            self.input_processor.process(prompt_token_ids, params, lora_request)
        if lora_request is not None:  # loaded on first use, as vLLM does
            self.core.add_lora(lora_request)
        core_reqs = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, kind, self.eos_token_ids,
            priority=priority, cache_salt=cache_salt, lora_request=lora_request, checked=True)
        try:
            for r in core_reqs:
                r.mm_features = features
                self.core.add_request(r)
        except ValueError:
            self.core.abort_requests(self.output_processor.abort_request(request_id))
            raise

    def process_images(self, prompt_token_ids: list[int],
                       multi_modal_data: MultiModalData) -> tuple[list[int], list]:
        """The prompt expanded for its images and their features (kvflow/multimodal/processor.py);
        ValueError naming multi_modal_data where the model takes no images."""
        if self.mm_processor is None:
            raise InvalidRequestError("multi_modal_data: this model does not take images",
                                      "multi_modal_data")
        return self.mm_processor.apply(list(prompt_token_ids), multi_modal_data)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            params: PoolingParams, prompt: str | None = None,
                            checked: bool = False,
                            lora_request: LoRARequest | None = None) -> None:
        """Queue an embedding request (prefill only), under `lora_request`'s adapter if given;
        `checked` as in add_request."""
        if not checked:
            self.input_processor.process_pooling(prompt_token_ids, params, lora_request)
        if lora_request is not None:  # loaded on first use, as for generation
            self.core.add_lora(lora_request)
        core_req = self.output_processor.add_pooling_request(request_id, prompt, prompt_token_ids,
                                                             params, checked=True,
                                                             lora_request=lora_request)
        try:
            self.core.add_request(core_req)
        except ValueError:
            self.core.abort_requests(self.output_processor.abort_request(request_id))
            raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter (False: registered already); ValueError if refused."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        core_out = self.core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_out.outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()
