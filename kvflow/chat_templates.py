"""Chat templates for model files that ship none (llama.cpp keeps such built-in templates too,
recognised by the model's tokens). The Gemma 3 GGUF that kvflow tests with has no
`tokenizer.chat_template`; GEMMA3 is Gemma 3's own template, as its instruction-tuned
checkpoints on Hugging Face carry it: turns between `<start_of_turn>` and `<end_of_turn>`, the
assistant's role named `model`, a system message folded into the first user turn, an image part
(`{"type": "image"}`) written as `<start_of_image>`, which the model's processor expands into
the image's tokens.

GEMMA4 is Gemma 4's format (Google's "Gemma 4 prompt formatting" page; the text parts of the
template its checkpoints carry): `<bos>`, then turns `<|turn>ROLE\n...<turn|>\n` with the roles
system, user and model (the assistant); a system (or developer) message is its own first
turn. Thinking is switched on by `<|think|>` at the very start of the system turn
(`chat_template_kwargs={"enable_thinking": true}`); the model then thinks inside
`<|channel>thought\n...<channel|>` before its answer. A past model turn keeps its answer only
(its thought channel is cut), and without thinking the generation prompt closes an empty
thought channel after `<|turn>model\n`, so the model answers directly. Tools and images are
not written (text only)."""
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

GEMMA4 = (
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set loop_messages = messages -%}"
    "{{ bos_token }}"
    "{%- if thinking or (messages and messages[0]['role'] in ['system', 'developer']) -%}"
    "{{ '<|turn>system\n' }}"
    "{%- if thinking -%}{{ '<|think|>' }}{%- endif -%}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if messages[0]['content'] is string -%}{{ messages[0]['content'] | trim }}"
    "{%- else -%}{%- for item in messages[0]['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{ '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{%- set texts = [message['content']] -%}"
    "{%- elif message['content'] is iterable -%}"
    "{%- set texts = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | list -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{%- for text in texts -%}"
    "{%- if role == 'model' -%}"  # a past answer without its thinking
    "{%- set ns = namespace(answer='') -%}"
    "{%- for part in text.split('<channel|>') -%}"
    "{%- set ns.answer = ns.answer + part.split('<|channel>')[0] -%}"
    "{%- endfor -%}"
    "{{ ns.answer | trim }}"
    "{%- else -%}{{ text | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|turn>model\n' }}"
    "{%- if not thinking -%}{{ '<|channel>thought\n<channel|>' }}{%- endif -%}"
    "{%- endif -%}"
)

# a token only that family's vocabulary has -> its template (Gemma 4 first: its vocabulary
# may keep Gemma 3's turn tokens too)
_BY_TOKEN = (("<|turn>", GEMMA4), ("<start_of_turn>", GEMMA3))


def builtin_chat_template(tokenizer) -> str | None:
    """The built-in template for a tokenizer without one, recognised by its special tokens
    (None: no match; such a model serves completions only)."""
    vocab = tokenizer.get_vocab()
    for token, template in _BY_TOKEN:
        if token in vocab:
            return template
    return None
