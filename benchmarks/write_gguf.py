"""GGUF files for the quantized-weights benchmarks, written tensor by tensor (the
writer gets every tensor's shape first, then each tensor's bytes in turn, so the model is
never in memory at once). Files go where you say (not the repository: they are large).

    python benchmarks/write_gguf.py requant SRC.gguf DST.gguf --type Q8_0
        SRC's metadata and tokenizer, every weight matrix dequantised and quantized again to
        --type (norms stay F32): a Q8_0 file of the default model.
    python benchmarks/write_gguf.py llama3-8b DST.gguf --type Q4_0 --tokenizer-from SRC.gguf
        Llama-3-8B's shapes (32 layers, hidden 4096, 32/8 heads, FFN 14336, vocab 128256,
        untied output) with random weights in --type blocks, and SRC's tokenizer padded to the
        vocabulary with unused control tokens.
    python benchmarks/write_gguf.py llama32-1b DST.gguf --type BF16 --tokenizer-from SRC.gguf
        Llama-3.2-1B's shapes (16 layers, hidden 2048, 32/8 heads, FFN 8192, tied output) with
        SRC's vocabulary (the default model's: 49152 tokens, not Llama 3's 128256, so that its
        tokenizer fits): 1.07B parameters, 2.15 GB in BF16."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

LLAMA3_8B = dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                 rope_theta=500000.0, ctx=8192, eps=1e-5, tied=False)
LLAMA32_1B = dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, vocab=None,
                  rope_theta=500000.0, ctx=8192, eps=1e-5, tied=True)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama32-1b": LLAMA32_1B}


def _copy_metadata(reader, writer, skip: tuple[str, ...] = ()) -> None:
    from gguf import GGUFValueType

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",) + skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def _write(writer, tensors: list[tuple[str, tuple[int, ...], object, int]], make) -> None:
    """tensors: (name, numpy shape, GGML type, byte count); make(name) -> its bytes/array."""
    from gguf.quants import quant_shape_to_byte_shape

    for name, shape, qtype, nbytes in tensors:
        if qtype.name == "F32":
            writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=qtype)
        else:  # the writer takes a quantized tensor's shape in bytes
            writer.add_tensor_info(name, quant_shape_to_byte_shape(shape, qtype), np.uint8, nbytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, *_rest) in enumerate(tensors):
        writer.write_tensor_data(make(name))
        if (i + 1) % 32 == 0 or i + 1 == len(tensors):
            print(f"{i + 1}/{len(tensors)} tensors written", file=sys.stderr, flush=True)
    writer.close()


def requant(src: str, dst: str, type_name: str) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize, quant_shape_to_byte_shape

    qtype = GGMLQuantizationType[type_name]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    _copy_metadata(reader, writer, skip=("general.file_type",))
    by_name = {t.name: t for t in reader.tensors}
    plan = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        target = qtype if len(shape) == 2 else GGMLQuantizationType.F32
        nbytes = int(np.prod(quant_shape_to_byte_shape(shape, target))) if target != GGMLQuantizationType.F32 \
            else int(np.prod(shape)) * 4
        plan.append((t.name, shape, target, nbytes))

    def make(name):
        t = by_name[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        return w if w.ndim == 1 else quantize(w, qtype)
    _write(writer, plan, make)


def llama_shaped(dst: str, type_name: str, tokenizer_from: str, shape: str | dict = "llama3-8b",
                 seed: int = 0) -> None:
    """A Llama of SHAPES[shape] (or the dict `shape`, its keys) with random weights (vocab
    None: the tokenizer's own)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize, quant_shape_to_byte_shape

    qtype = GGMLQuantizationType[type_name]
    src = GGUFReader(tokenizer_from)
    s = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    if s["vocab"] is None:
        s["vocab"] = len(src.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(dst, "llama")
    writer.add_name(f"random-{shape if isinstance(shape, str) else 'llama'}-shapes")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["ctx"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_vocab_size(s["vocab"])
    writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    for field in src.fields.values():  # the tokenizer, padded to the vocabulary
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<|unused_{i}|>" for i in range(s["vocab"] - len(value))]
        elif field.name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value + [3 if field.name.endswith("type") else 0.0] * (s["vocab"] - len(value))
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    h, f, kv = s["hidden"], s["ffn"], s["kv_heads"] * (s["hidden"] // s["heads"])
    shapes = {"token_embd.weight": (s["vocab"], h), "output_norm.weight": (h,)}
    if not s["tied"]:
        shapes["output.weight"] = (s["vocab"], h)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                       b + "attn_q.weight": (h, h), b + "attn_k.weight": (kv, h),
                       b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, h),
                       b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h),
                       b + "ffn_down.weight": (h, f)})
    plan = []
    for name, shape in shapes.items():
        if len(shape) == 1:
            plan.append((name, shape, GGMLQuantizationType.F32, shape[0] * 4))
        else:
            plan.append((name, shape, qtype, int(np.prod(quant_shape_to_byte_shape(shape, qtype)))))
    rng = np.random.default_rng(seed)
    # one quantized template row block reused with random row shuffles keeps writing fast:
    # random N(0, 0.02) values, quantized once per distinct shape
    templates = {}

    def make(name):
        shape = shapes[name]
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        n, k = shape
        if k not in templates:
            templates[k] = quantize((rng.standard_normal((4096, k)) * 0.02).astype(np.float32), qtype)
        t = templates[k]
        return t[rng.integers(0, len(t), n)]
    _write(writer, plan, make)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["requant", *SHAPES])
    p.add_argument("src_or_dst")
    p.add_argument("dst", nargs="?")
    p.add_argument("--type", default="Q8_0")
    p.add_argument("--tokenizer-from")
    a = p.parse_args()
    if a.what == "requant":
        requant(a.src_or_dst, a.dst, a.type)
    else:
        llama_shaped(a.src_or_dst, a.type, a.tokenizer_from, a.what)
    print(f"wrote {a.dst or a.src_or_dst}: {os.path.getsize(a.dst or a.src_or_dst) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
