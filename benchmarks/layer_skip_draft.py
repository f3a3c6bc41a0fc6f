"""A draft model for speculative decoding that shares the default model's tokenizer: the
default model with layers skipped (a layer-skip self-draft), either cut to its first N layers
or keeping a chosen set (e.g. the first 10 and the last 6, skipping the middle, as in
self-speculative decoding). The embeddings, the final norm and the LM head stay; every tensor
is copied as stored (Q4_1 stays Q4_1), the kept blocks are renumbered and
`llama.block_count` changes. No smaller model with SmolLM2's tokenizer is installed, and none
is ever downloaded: this one is written from the file at hand, once.

    .venv/bin/python benchmarks/layer_skip_draft.py --layers 8 [--out DIR]
        -> DIR/smollm2-135m-first8.gguf (DIR defaults to benchmarks/results/)
    .venv/bin/python benchmarks/layer_skip_draft.py --keep 0-9,24-29
        -> DIR/smollm2-135m-keep0-9_24-29.gguf

Use it as `{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`
(benchmarks/spec_decode.py --draft-layers N writes and uses it)."""
from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def parse_keep(spec: str) -> list[int]:
    """"0-9,24-29" -> [0, 1, ..., 9, 24, ..., 29]."""
    kept = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        kept.extend(range(int(lo), int(hi or lo) + 1))
    return kept


def write_layer_skip_draft(num_layers: int | None = None, out_dir: str = RESULTS,
                           src: str | None = None, keep: str | None = None) -> str:
    """The path of the default GGUF with only its first `num_layers` blocks, or the blocks
    `keep` names ("0-9,24-29"), in order (written once)."""
    from gguf import GGUFReader, GGUFWriter

    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    from write_gguf import _copy_metadata, _write
    from kvflow.model_path import default_model_path

    src = src or default_model_path()
    layers = parse_keep(keep) if keep else list(range(num_layers))
    tag = f"keep{keep.replace(',', '_')}" if keep else f"first{num_layers}"
    dst = os.path.join(out_dir, f"smollm2-135m-{tag}.gguf")
    if os.path.isfile(dst):
        return dst
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not layers or sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= total \
            or len(layers) == total:
        raise ValueError(f"the kept layers must be distinct, ascending, fewer than all and in "
                         f"0..{total - 1} (the model has {total}), got {layers}")
    new_index = {old: new for new, old in enumerate(layers)}
    kept = {}  # new name -> tensor
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m is None:
            kept[t.name] = t
        elif int(m.group(1)) in new_index:
            kept[f"blk.{new_index[int(m.group(1))]}.{t.name[m.end():]}"] = t
    os.makedirs(out_dir, exist_ok=True)
    tmp = dst + ".part"
    writer = GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer, skip=(f"{arch}.block_count", "general.name"))
    writer.add_name(f"SmolLM2-135M-Instruct layers {keep or f'0-{num_layers - 1}'} of {total}")
    writer.add_block_count(len(layers))
    plan = [(name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type, int(t.n_bytes))
            for name, t in kept.items()]
    _write(writer, plan, lambda name: kept[name].data)  # the stored bytes, unchanged
    os.replace(tmp, dst)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--layers", type=int, help="keep the first N layers")
    which.add_argument("--keep", help="keep these layers, e.g. 0-9,24-29")
    p.add_argument("--out", default=RESULTS, help="folder for the file")
    a = p.parse_args()
    path = write_layer_skip_draft(a.layers, a.out, keep=a.keep)
    print(f"wrote {path}: {os.path.getsize(path) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
