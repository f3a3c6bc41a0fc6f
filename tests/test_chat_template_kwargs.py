"""chat_template_kwargs (vLLM's field): variables a chat template reads, such as SmolLM3's and
Qwen3's `enable_thinking`, through LLM.chat, the server's chat rendering and /tokenize; bounded
like every field that arrives over the network (a 400 naming the field)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tiny_arch_models import BUILDERS
from kvflow.entrypoints.openai.protocol import MAX_TEMPLATE_KWARGS, ChatCompletionRequest, TokenizeRequest
from kvflow.entrypoints.openai.serving_chat import render_and_encode
from kvflow.tokenizer import get_tokenizer

MESSAGES = [{"role": "user", "content": "Hi there"}]
EMPTY_THINK = "<think>\n\n</think>\n"


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    return BUILDERS["smollm3"](str(tmp_path_factory.mktemp("smollm3") / "hf"))


def test_enable_thinking_and_the_system_flags_reach_smollm3s_template(smollm3):
    tok = get_tokenizer(smollm3)
    think, _ = render_and_encode(tok, MESSAGES, True)
    no_think, ids = render_and_encode(tok, MESSAGES, True, None, {"enable_thinking": False})
    assert "Reasoning Mode: /think" in think and not think.endswith(EMPTY_THINK)
    assert "Reasoning Mode: /no_think" in no_think and no_think.endswith(EMPTY_THINK)
    assert ids == tok.encode(no_think, add_special_tokens=False)
    flagged, _ = render_and_encode(tok, [{"role": "system", "content": "Be brief. /no_think"}, *MESSAGES], True)
    assert flagged == no_think


@pytest.mark.slow
def test_llm_chat_takes_chat_template_kwargs(smollm3):
    from kvflow import LLM, SamplingParams

    llm = LLM(smollm3, dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    plain = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    off = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt.endswith(EMPTY_THINK) and not plain.prompt.endswith(EMPTY_THINK)
    assert len(off.prompt_token_ids) > len(plain.prompt_token_ids)


def test_the_request_fields_take_bounded_template_variables():
    body = {"messages": MESSAGES}
    ok = ChatCompletionRequest(**body, chat_template_kwargs={"enable_thinking": False, "style": ["a"]})
    assert ok.chat_template_kwargs == {"enable_thinking": False, "style": ["a"]}
    assert TokenizeRequest(**body, chat_template_kwargs={"enable_thinking": True}).chat_template_kwargs
    for bad, needle in [({f"k{i}": 1 for i in range(MAX_TEMPLATE_KWARGS + 1)}, "at most"),
                        ({"not a name": 1}, "not a name"), ({"x" * 65: 1}, "not a name"),
                        ({"tokenize": True}, "its own request field"),
                        ({"add_generation_prompt": False}, "its own request field"),
                        ({"blob": "x" * 20000}, "characters of JSON")]:
        for model in (ChatCompletionRequest, TokenizeRequest):
            with pytest.raises(ValidationError, match=needle) as err:
                model(**body, chat_template_kwargs=bad)
            assert "chat_template_kwargs" in str(err.value)
