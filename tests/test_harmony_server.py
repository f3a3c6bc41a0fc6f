"""gpt-oss's harmony format through `kvflow serve --reasoning-parser openai_gptoss
--tool-call-parser openai`, with the `openai` client: the analysis channel is
`reasoning_content` (a `reasoning` item), a message to `functions.NAME` a tool call (a
`function_call` item), the final channel the content; streamed and not.

The model is the tiny random gpt-oss with a byte-level tokenizer that has harmony's special
tokens and a small harmony chat template in its folder. What it writes is forced by a Lark
grammar (`structured_outputs`, llguidance) naming those special tokens: the grammar holds
from the first token under `openai_gptoss`, and the parsers read the text the detokenizer
gives them, special tokens kept."""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from conftest_model_helpers import save_byte_tokenizer
from server_helpers import ServerProcess
from tiny_arch_models import BUILDERS, VOCAB

pytestmark = pytest.mark.slow

SPECIALS = ("<unk>", "<s>", "</s>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>")
RETURN, CALL = SPECIALS.index("<|return|>"), SPECIALS.index("<|call|>")
# harmony's shape, as the checkpoints' own templates write it: calls with the recipient in the
# role part and their arguments as JSON, a tool's answer from functions.NAME to the assistant
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: low<|end|>"
    "{% if tools %}<|start|>developer<|message|>namespace functions { "
    "{% for t in tools %}type {{ t.function.name }}; {% endfor %}}<|end|>{% endif %}"
    "{% set last = namespace(name=none) %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% set last.name = c.function.name %}{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>"
    "commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")

MODEL = "hf"  # the served name: the model folder's
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ARGS = '{"city": "Paris"}'
# what the model is made to write; the grammar leaves out the stop token, which ends it
CALL_OUTPUT = ('start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> '
               '<|start|> "assistant" <|channel|> "commentary to=functions.get_weather " '
               '<|constrain|> "json" <|message|> ' + json.dumps(ARGS))
CALL_OUTPUT_RECIPIENT_FIRST = (
    'start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> '
    '<|start|> "assistant to=functions.get_weather" <|channel|> "commentary json" <|message|> '
    + json.dumps(ARGS))
FINAL_OUTPUT = ('start: <|channel|> "analysis" <|message|> "Easy." <|end|> '
                '<|start|> "assistant" <|channel|> "final" <|message|> "It is sunny."')


def save_harmony_gpt_oss(path: str) -> str:
    """The tiny gpt-oss with harmony's special tokens, its template and stop tokens."""
    from transformers import AutoTokenizer

    BUILDERS["gpt_oss"](path)
    save_byte_tokenizer(path, VOCAB, SPECIALS)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "chat_template.jinja"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [RETURN, 2, CALL]}, f)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_harmony_gpt_oss(str(tmp_path_factory.mktemp("harmony") / "hf"))
    srv = ServerProcess("--model", path, "--dtype", "float32", "--max-model-len", "512",
                        "--num-blocks", "64", "--reasoning-parser", "openai_gptoss",
                        "--tool-call-parser", "openai")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def forced(grammar: str) -> dict:
    return {"structured_outputs": {"grammar": grammar}}


@pytest.mark.parametrize("grammar", [CALL_OUTPUT, CALL_OUTPUT_RECIPIENT_FIRST])
def test_analysis_is_reasoning_and_the_call_a_tool_call(client, grammar):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                       temperature=0, extra_body=forced(grammar))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)


def test_streamed_call_arrives_as_deltas_without_special_tokens(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            max_tokens=120, temperature=0, stream=True,
                                            extra_body=forced(CALL_OUTPUT))
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    assert "".join(reasoning) == "Need the weather." and len([r for r in reasoning if r]) > 1
    assert not any(d.content for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert {tc.index for tc in calls} == {0}
    assert "".join(tc.function.arguments or "" for tc in calls) == ARGS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_final_channel_is_the_content(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                       temperature=0, extra_body=forced(FINAL_OUTPUT))
    message = r.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Easy.", "It is sunny.")
    assert r.choices[0].finish_reason == "stop" and not message.tool_calls
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                            temperature=0, stream=True,
                                            extra_body=forced(FINAL_OUTPUT))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Easy."


def test_responses_have_reasoning_and_function_call_items(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(model=MODEL, input=ASK, tools=tools, max_output_tokens=120,
                                temperature=0, extra_body=forced(CALL_OUTPUT))
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "Need the weather."
    assert (r.output[1].name, r.output[1].arguments) == ("get_weather", ARGS)
    assert r.output[1].call_id.startswith("call_")

    events = list(client.responses.create(model=MODEL, input=ASK, tools=tools,
                                          max_output_tokens=120, temperature=0, stream=True,
                                          extra_body=forced(CALL_OUTPUT)))
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == "Need the weather."
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == ARGS
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"]

    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=120, temperature=0,
                                extra_body=forced(FINAL_OUTPUT))
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output_text == "It is sunny."


def test_tool_calls_and_answers_go_back_through_the_template(server, client):
    """The assistant's call and the tool's answer render as harmony messages (the arguments
    once as JSON, not a JSON string of JSON), and the conversation is served."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = httpx.post(f"{server.url}/tokenize", timeout=60,
                     json={"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", timeout=60, json={"tokens": ids}).json()["prompt"]
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            + ARGS + "<|call|>") in prompt
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"'
            "<|end|><|start|>assistant") in prompt
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=60,
                                       temperature=0, extra_body=forced(FINAL_OUTPUT))
    assert r.choices[0].message.content == "It is sunny."
    assert r.usage.prompt_tokens == len(ids)


def test_without_the_parsers_requests_keep_special_tokens_skipped(client):
    """skip_special_tokens=false is the parsers' own business: a plain completion (no chat)
    still skips them by default, as vLLM."""
    r = client.completions.create(model=MODEL, prompt="<|start|>user<|message|>hi<|end|>",
                                  max_tokens=60, temperature=0, extra_body=forced(FINAL_OUTPUT))
    assert r.choices[0].text == "analysisEasy.assistantfinalIt is sunny."
