"""Incremental detokenization: streamed deltas, partial characters, stop strings."""
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvflow.engine.detokenizer import IncrementalDetokenizer, decode_token
from kvflow.model_path import default_model_path
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import get_tokenizer

TEXTS = {
    "english": "Hello world, the capital of France is Paris. It is a lovely city!",
    "cjk": "東京は日本の首都です",
    "emoji": "🎉🚀👍🏽 family: 👨‍👩‍👧",
}


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return get_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A SentencePiece-shaped tokenizer (metaspace + byte fallback), where a lone token decodes
    differently from the same token in context and one character spans several byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(c, len(vocab))
    merges = []
    for word in ["▁the", "▁is", "▁of", "▁Paris", "▁capital", "▁France", "▁Hello", "▁world"]:
        piece = word[0]
        for ch in word[1:]:
            merges.append((piece, ch))
            piece += ch
            vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(params=["smollm", "byte_fallback"])
def tokenizer(request, smollm_tokenizer, byte_fallback_tokenizer):
    return smollm_tokenizer if request.param == "smollm" else byte_fallback_tokenizer


def stream(tokenizer, text, params=None, chunk=1, prompt="Say:"):
    """Feed `text`'s tokens `chunk` at a time; return (deltas, detokenizer, expected full text)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The output as it reads after the prompt (a leading space may depend on the context).
    expected = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = detok.update(ids[i:i + chunk], finished=last)
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    return deltas, detok, expected


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_join_to_the_full_decode(tokenizer, name, chunk):
    deltas, detok, expected = stream(tokenizer, TEXTS[name], chunk=chunk)
    assert "".join(deltas) == detok.output_text == expected
    assert expected.strip() == TEXTS[name]
    assert not any("\ufffd" in d for d in deltas)


def test_each_step_decodes_a_short_window(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode(TEXTS["english"] * 30, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    widest = 0
    for t in ids:
        detok.update([t])
        widest = max(widest, len(detok.token_ids) - detok.prefix_offset)
    assert len(ids) > 400 and widest <= 4
    assert detok.output_text == tok.decode(ids)


def shown_prefixes(deltas):
    text = ""
    for d in deltas:
        text += d
        yield text


@pytest.mark.parametrize("stop", ["Paris", "s Pa", "is a", "city!"])
def test_stop_string_never_reaches_the_client(tokenizer, stop):
    text = TEXTS["english"]
    deltas, detok, expected = stream(tokenizer, text, SamplingParams(stop=["zzz", stop]))
    cut = expected[:expected.index(stop)]
    assert detok.stop_reason == stop
    assert detok.output_text == "".join(deltas) == cut
    assert not any(stop in shown for shown in shown_prefixes(deltas))


def test_overlapping_stop_prefix_is_released_once_it_cannot_match(smollm_tokenizer):
    # "1 2 1 2 3": "1 2" looks like the start of the stop twice; only the second one is.
    params = SamplingParams(stop=["1 2 3"])
    deltas, detok, _ = stream(smollm_tokenizer, "count 1 2 1 2 3 done", params)
    assert detok.output_text == "".join(deltas) == "count 1 2 "
    assert detok.stop_reason == "1 2 3"
    assert not any("1 2 3" in shown for shown in shown_prefixes(deltas))


def test_include_stop_str_in_output_keeps_it_and_drops_the_rest(tokenizer):
    params = SamplingParams(stop=["capital of"], include_stop_str_in_output=True)
    deltas, detok, expected = stream(tokenizer, TEXTS["english"], params)
    end = expected.index("capital of") + len("capital of")
    assert detok.output_text == "".join(deltas) == expected[:end]


def test_text_after_the_stop_within_the_same_token_is_dropped(smollm_tokenizer):
    # " Paris" is one token; a stop of "Par" must cut inside it.
    deltas, detok, expected = stream(smollm_tokenizer, TEXTS["english"], SamplingParams(stop=["Par"]))
    assert detok.output_text == "".join(deltas) == expected[:expected.index("Par")]
    assert detok.update(smollm_tokenizer.encode(" more text")) is None  # finished: ignored
    assert detok.output_text == expected[:expected.index("Par")] and detok.get_delta() == ""


def test_finishing_flushes_text_held_back_for_a_possible_stop(smollm_tokenizer):
    tok = smollm_tokenizer
    params = SamplingParams(stop=["Paris, France"])
    prompt = tok.encode("Q:", add_special_tokens=False)
    ids = tok.encode(" I live in Paris", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, params)
    assert detok.update(ids) is None
    held = detok.get_delta()
    assert held == " I live in "  # "Paris" might still become the stop string
    assert detok.update([], finished=True) is None
    assert held + detok.get_delta() == detok.output_text == " I live in Paris"


def test_special_tokens_follow_skip_special_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
        deltas = []
        for i, t in enumerate(ids):
            detok.update([t], finished=i == len(ids) - 1)
            deltas.append(detok.get_delta())
        expected = "Hi there" + ("" if skip else tok.eos_token)
        assert "".join(deltas) == detok.output_text == expected


def test_decode_token_gives_the_text_of_one_token(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(decode_token(tokenizer, i) for i in ids).replace(" ", "") == "Helloworld"
    assert decode_token(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token
