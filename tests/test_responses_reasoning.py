"""`--reasoning-parser` and `--tool-call-parser` through the Responses and Messages APIs: one
real `kvflow serve` of the default model with `deepseek_r1`, under which every output begins in
reasoning (the tiny model never writes `</think>`, so all it says is reasoning): a `reasoning`
output item, a `thinking` block, streamed as their own events and equal to the chat API's
`reasoning_content`; and with `hermes`, tool_choice auto is served."""
from __future__ import annotations

import anthropic
import openai
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "256", "--num-blocks", "64",
                        "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def chat_reasoning(server) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    reasoning = reply.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    return reasoning


def test_the_reasoning_is_a_reasoning_item(server, chat_reasoning):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0)
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == chat_reasoning
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 8

    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat_reasoning
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [chat_reasoning]


def test_the_reasoning_is_a_thinking_block(server, chat_reasoning):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    m = client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                               extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking"] and m.stop_reason == "max_tokens"
    assert m.content[0].thinking == chat_reasoning
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.thinking for e in events
              if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == chat_reasoning == final.content[0].thinking
    # a thinking block handed back is accepted, and left out of the prompt
    def later(answer) -> list[dict]:
        return [*ASK, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And two more?"}]
    again = client.messages.create(model=MODEL, max_tokens=2, messages=later(m.content),
                                   extra_body={"temperature": 0})
    assert again.usage.input_tokens == client.messages.count_tokens(
        model=MODEL, messages=later("")).input_tokens


def test_tool_choice_auto_is_served_with_a_tool_call_parser(server):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0,
                             tools=[{"type": "function", "name": "get_weather",
                                     "parameters": schema}])
    assert r.tool_choice == "auto" and r.output[0].type == "reasoning"
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 0},
                               tools=[{"name": "get_weather", "input_schema": schema}])
    assert m.content[0].type == "thinking"
