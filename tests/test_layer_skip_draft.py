"""benchmarks/layer_skip_draft.py: the default GGUF with some of its layers, the draft model of
the draft-model speculation benchmark. The kept blocks are renumbered, their bytes unchanged,
and the file loads as a model of that many layers with the default model's vocabulary."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from layer_skip_draft import parse_keep, write_layer_skip_draft  # noqa: E402

pytestmark = pytest.mark.slow  # reads the default model's file (with its tokenizer) twice


def test_keep_names_ranges_and_single_layers():
    assert parse_keep("0-2,5,28-29") == [0, 1, 2, 5, 28, 29]


def test_kept_layers_are_renumbered_with_their_bytes(default_model_path, tmp_path):
    from gguf import GGUFReader

    from kvflow.model.arch import load_arch_config

    path = write_layer_skip_draft(out_dir=str(tmp_path), src=default_model_path, keep="0,29")
    src, dst = GGUFReader(default_model_path), GGUFReader(path)
    draft = load_arch_config(path)
    assert draft.num_hidden_layers == 2 and src.fields["llama.block_count"].contents() == 30
    assert draft.vocab_size == 49152 and draft.hidden_size == 576
    src_t = {t.name: t for t in src.tensors}
    dst_t = {t.name: t for t in dst.tensors}
    assert not any(n.startswith("blk.2.") for n in dst_t)
    for name, old in (("blk.0.attn_q.weight", "blk.0.attn_q.weight"),
                      ("blk.1.ffn_down.weight", "blk.29.ffn_down.weight"),
                      ("token_embd.weight", "token_embd.weight")):
        assert dst_t[name].tensor_type == src_t[old].tensor_type
        assert np.array_equal(np.asarray(dst_t[name].data), np.asarray(src_t[old].data))


def test_a_draft_with_every_layer_is_refused(default_model_path, tmp_path):
    with pytest.raises(ValueError, match="fewer than all"):
        write_layer_skip_draft(30, out_dir=str(tmp_path), src=default_model_path)
