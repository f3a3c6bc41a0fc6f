"""The tokenizer of an HF folder or a GGUF file (transformers' fast tokenizer).

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once in the
model's cache folder and loaded from there on every later start: converted under a lock (two
starts convert once), fsynced and renamed into place; a cached copy that fails to load (torn by
a crash) is converted again."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from kvflow.chat_templates import builtin_chat_template
from kvflow.model_path import cache_dir_for, is_gguf
from kvflow.utils.files import file_lock, publish

logger = logging.getLogger("kvflow")


def tokenizer_source(tokenizer: str | None, model_path: str) -> str:
    """Where the tokenizer loads from: the `tokenizer` option (an HF folder or .gguf file), else
    the model itself."""
    if tokenizer is None:
        return model_path
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if not os.path.exists(path):
        raise ValueError(f"tokenizer {tokenizer!r} is neither a folder nor a file")
    return path


def get_tokenizer(path: str):
    """A `transformers` tokenizer (with chat template and `eos_token_id`) for `path`."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoTokenizer

    if not is_gguf(path):
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not getattr(tokenizer, "chat_template", None):  # a folder without one
            tokenizer.chat_template = builtin_chat_template(tokenizer)
        return tokenizer
    cached = os.path.join(cache_dir_for(path), "tokenizer")
    tokenizer = _load_cached(cached, remove_if_broken=False)
    if tokenizer is not None:
        return tokenizer
    with file_lock(cached + ".lock"):
        # another start may have converted it meanwhile; a broken copy is removed here only
        tokenizer = _load_cached(cached, remove_if_broken=True)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                          gguf_file=os.path.basename(path))
            except (ValueError, TypeError, StrictDataclassFieldValidationError) as e:
                # TypeError: transformers' gpt-oss GGUF reader fails on llama.cpp's rope.scaling
                # keys (it reads a field's first part, the key's length, as its value); the
                # validation error: its gemma4 config takes no per-layer feed_forward_length
                if isinstance(e, ValueError) and "is not supported yet" not in str(e):
                    raise
                tokenizer = _from_gguf_metadata(path)
            if not getattr(tokenizer, "chat_template", None):  # a GGUF without one
                tokenizer.chat_template = builtin_chat_template(tokenizer)
            _save_atomically(tokenizer, cached)
    return tokenizer


def _from_gguf_metadata(path: str):
    """The tokenizer a GGUF file's metadata describes, for an architecture transformers does not
    load as a model from GGUF (OLMo 2, Granite): the vocabulary, merges, special tokens and chat
    template are the same keys whatever the architecture, and transformers builds them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                       get_gguf_tokenizer)

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _load_cached(cached: str, remove_if_broken: bool):
    """The cached tokenizer, or None when there is none or it does not load."""
    from transformers import AutoTokenizer

    if not os.path.isdir(cached):
        return None
    try:
        if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
            raise ValueError("tokenizer.json is missing")
        return AutoTokenizer.from_pretrained(cached)
    except Exception as e:  # noqa: BLE001 - any broken cache is rebuilt, never trusted
        if remove_if_broken:
            logger.warning("kvflow: the cached tokenizer %s does not load (%s); converting "
                           "again", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
        return None


def _save_atomically(tokenizer, target: str) -> None:
    """Write to a private folder, fsync it, then rename it into place (under the lock)."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tokenizer.", dir=parent)
    try:
        tokenizer.save_pretrained(tmp)
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """Apply the model's chat template; returns the text and its token ids. The template writes
    its own special tokens (BOS and the like), so they are not added again. `tools` (OpenAI's
    function definitions) reach the template as transformers passes them;
    `chat_template_kwargs`, variables the template reads (e.g. `enable_thinking`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a completion instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools, **(chat_template_kwargs or {}))
    return text, tokenizer.encode(text, add_special_tokens=False)
