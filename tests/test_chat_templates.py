"""kvflow's built-in chat templates, used where a model's files carry none, chosen by the
tokenizer's special tokens. Gemma 4's renders the examples of Google's Gemma 4 prompt-formatting
page: a system turn, user and model turns between `<|turn>` and `<turn|>`, `<|think|>` first in
the system turn to think, a past answer without its thought channel."""
from __future__ import annotations

import pytest

from kvflow.chat_templates import GEMMA3, GEMMA4, builtin_chat_template

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]


def _tokenizer(specials: list[str], folder=None):
    """A word-level tokenizer whose special tokens are `specials` (Gemma 4's, or Gemma 3's),
    saved without a chat template to `folder` when given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + ["<unk>", "hello", "."])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=[t for t in specials if t.startswith("<|") or t.endswith("|>")])
    if folder is not None:
        tok.save_pretrained(folder)
    return tok


CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello."},
                {"role": "assistant", "content": "Hi! How can I help?"},
                {"role": "user", "content": "What is the water formula?"}]


def test_gemma4_renders_system_user_and_model_turns_as_documented():
    tok = _tokenizer(SPECIALS)
    tok.chat_template = builtin_chat_template(tok)
    assert tok.chat_template == GEMMA4
    text = tok.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert text == ("<bos><|turn>system\nYou are a helpful assistant.<turn|>\n"
                    "<|turn>user\nHello.<turn|>\n"
                    "<|turn>model\nHi! How can I help?<turn|>\n")
    # the generation prompt opens the model's turn; without thinking its thought channel is empty
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|turn>user\nWhat is the water formula?<turn|>\n"
                         "<|turn>model\n<|channel>thought\n<channel|>")


def test_gemma4_thinking_goes_first_in_the_system_turn_and_past_thoughts_are_cut():
    tok = _tokenizer(SPECIALS)
    tok.chat_template = GEMMA4
    messages = [CONVERSATION[1], {"role": "assistant",
                                  "content": "<|channel>thought\nA greeting.\n<channel|>Hi! How can I help?"},
                CONVERSATION[3]]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert text == ("<bos><|turn>system\n<|think|><turn|>\n"  # the page's thinking example
                    "<|turn>user\nHello.<turn|>\n"
                    "<|turn>model\nHi! How can I help?<turn|>\n"
                    "<|turn>user\nWhat is the water formula?<turn|>\n"
                    "<|turn>model\n")
    with_system = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, enable_thinking=True)
    assert with_system.startswith("<bos><|turn>system\n<|think|>You are a helpful assistant.<turn|>\n")
    # no system message and no thinking: no system turn at all
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False) == "<bos><|turn>user\nHello.<turn|>\n"


def test_builtin_template_is_chosen_by_the_families_tokens():
    assert builtin_chat_template(_tokenizer(SPECIALS + ["<start_of_turn>", "<end_of_turn>"])) == GEMMA4
    assert builtin_chat_template(_tokenizer(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])) == GEMMA3
    assert builtin_chat_template(_tokenizer(["<pad>", "<eos>", "<bos>"])) is None


def test_a_gemma4_folder_without_a_template_gets_the_builtin(tmp_path):
    from kvflow.tokenizer import get_tokenizer

    _tokenizer(SPECIALS, folder=tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert tok.chat_template == GEMMA4
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True) == \
        "<bos><|turn>user\nHello.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


@pytest.mark.parametrize("content", [[{"type": "text", "text": " Hello. "}], " Hello. "])
def test_gemma4_takes_text_parts_and_trims_them(content):
    tok = _tokenizer(SPECIALS)
    tok.chat_template = GEMMA4
    assert tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False) == \
        "<bos><|turn>user\nHello.<turn|>\n"
