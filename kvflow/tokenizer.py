"""The tokenizer of an HF folder or a GGUF file (transformers' fast tokenizer).

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once in the
model's cache folder and loaded from there on every later start."""
from __future__ import annotations

import os
import shutil
import tempfile

from kvflow.model_path import cache_dir_for, is_gguf


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
    from transformers import AutoTokenizer

    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    cached = os.path.join(cache_dir_for(path), "tokenizer")
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _save_atomically(tokenizer, cached)
    return tokenizer


def _save_atomically(tokenizer, target: str) -> None:
    # Several processes may start at once: write to a private folder, then rename into place.
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tokenizer.", dir=parent)
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; theirs is identical


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """Apply the model's chat template; returns the text and its token ids. The template writes
    its own special tokens (BOS and the like), so they are not added again."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a completion instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return text, tokenizer.encode(text, add_special_tokens=False)
