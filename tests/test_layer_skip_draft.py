"""benchmarks/layer_skip_draft.py: the default GGUF with some of its layers, the draft model of
the draft-model speculation benchmark. The kept blocks are renumbered, their bytes unchanged,
and the file loads as a model of that many layers with the default model's vocabulary; as a
draft it is served quantized, like the target, and the target's outputs stay its own."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from layer_skip_draft import parse_keep, write_layer_skip_draft  # noqa: E402

pytestmark = pytest.mark.slow  # reads and loads the default model's file


def test_keep_names_ranges_and_single_layers():
    assert parse_keep("0-2,5,28-29") == [0, 1, 2, 5, 28, 29]


@pytest.fixture(scope="module")
def first_and_last(default_model_path, tmp_path_factory) -> str:
    return write_layer_skip_draft(out_dir=str(tmp_path_factory.mktemp("draft")),
                                  src=default_model_path, keep="0,29")


def test_kept_layers_are_renumbered_with_their_bytes(default_model_path, first_and_last):
    from gguf import GGUFReader

    src, dst = GGUFReader(default_model_path), GGUFReader(first_and_last)
    assert src.fields["llama.block_count"].contents() == 30
    assert dst.fields["llama.block_count"].contents() == 2
    src_t = {t.name: t for t in src.tensors}
    dst_t = {t.name: t for t in dst.tensors}
    assert not any(n.startswith("blk.2.") for n in dst_t)
    for name, old in (("blk.0.attn_q.weight", "blk.0.attn_q.weight"),
                      ("blk.1.ffn_down.weight", "blk.29.ffn_down.weight"),
                      ("token_embd.weight", "token_embd.weight")):
        assert dst_t[name].tensor_type == src_t[old].tensor_type
        assert np.array_equal(np.asarray(dst_t[name].data), np.asarray(src_t[old].data))


def test_as_a_draft_it_stays_quantized_and_the_outputs_are_the_targets(first_and_last,
                                                                        prompt_ids):
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode, spec in (("off", None), ("on", {"method": "draft_model", "model": first_and_last,
                                              "num_speculative_tokens": 3,
                                              "min_acceptance_rate": 0.0})):
        # float32 activations over the stored Q4_1 weights: greedy outputs are exact
        llm = LLM(None, dtype="float32", max_model_len=512, num_blocks=64, warmup=False,
                  speculative_config=spec)
        try:
            outputs[mode] = [o.outputs[0].token_ids
                             for o in llm.generate(prompt_ids[:2], params, use_tqdm=False)]
            if spec is not None:
                core = llm.engine.core
                assert core.spec.proposer.quantization == "gguf"
                assert core.spec.proposer.arch.num_hidden_layers == 2
                assert core.scheduler.spec_stats.num_draft_tokens > 0
        finally:
            llm.engine.shutdown()
    assert outputs["on"] == outputs["off"]
