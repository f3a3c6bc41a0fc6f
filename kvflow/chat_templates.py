"""Chat templates for GGUF files that ship none (llama.cpp keeps such built-in templates too,
recognised by the model's tokens). The Gemma 3 GGUF that kvflow tests with has no
`tokenizer.chat_template`; this is Gemma 3's own template, as its instruction-tuned
checkpoints on Hugging Face carry it: turns between `<start_of_turn>` and `<end_of_turn>`, the
assistant's role named `model`, a system message folded into the first user turn, an image part
(`{"type": "image"}`) written as `<start_of_image>`, which the model's processor expands into
the image's tokens."""
from __future__ import annotations

GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# a token only that family's vocabulary has -> its template
_BY_TOKEN = (("<start_of_turn>", GEMMA3),)


def builtin_chat_template(tokenizer) -> str | None:
    """The built-in template for a tokenizer without one, recognised by its special tokens
    (None: no match; such a model serves completions only)."""
    vocab = tokenizer.get_vocab()
    for token, template in _BY_TOKEN:
        if token in vocab:
            return template
    return None
