"""The default model as one set of weights that every engine of the benchmark reads:

- an HF folder (config.json, model.safetensors in fp32, tokenizer) from the GGUF file, through
  kvflow's own reader (Q4_1 dequantised to fp32 is exact, so nothing is rounded twice);
- GGUF files for llama.cpp converted from that folder (f32 and bf16), with the
  convert_hf_to_gguf.py that the llama-cpp-python sdist carries;
- a compressed-tensors int8 W8A8 folder of it (for vLLM and kvflow: --w8a8).

Both are cached under benchmarks/results/ and built only once.

    .venv/bin/python benchmarks/export_model.py [--gguf] [--w8a8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
HF_DIR = os.path.join(RESULTS, "smollm2-135m-instruct-hf")
LLAMACPP_VENV = os.path.join(HERE, ".venv-llamacpp")


def export_hf_folder(out_dir: str | None = None, dtype: str = "float32") -> str:
    """Write the default GGUF model as an HF folder (safetensors in `dtype`, float32 or
    bfloat16, + tokenizer). The bf16 folder is what most HF checkpoints are (SmolLM2's own is
    bf16): every engine then reads the same bf16 values, widened exactly where it computes in
    fp32, and kvflow's weight_dtype=bfloat16 stores them as they are."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the HF folder is exported in float32 or bfloat16, not {dtype!r}")
    out_dir = out_dir or (HF_DIR if dtype == "float32" else HF_DIR + "-bf16")
    if os.path.isfile(os.path.join(out_dir, ".complete")):
        return out_dir
    sys.path.insert(0, ROOT)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kvflow.checkpoint.gguf import read_gguf
    from kvflow.model_path import default_model_path

    gguf = default_model_path()
    folder, fname = os.path.split(gguf)
    os.makedirs(out_dir, exist_ok=True)
    arch, arrays = read_gguf(gguf)
    tensors = {k: torch.from_numpy(v.copy()).to(getattr(torch, dtype)).contiguous()
               for k, v in arrays.items()}
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    config.dtype = dtype
    config.architectures = [arch.architecture]  # converters pick the model class from this
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, f)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir


W8A8_DIR = os.path.join(RESULTS, "smollm2-135m-instruct-w8a8")


def export_w8a8(out_dir: str = W8A8_DIR, hf_dir: str = HF_DIR) -> str:
    """The HF folder as a compressed-tensors int8 W8A8 checkpoint (per-channel weights, dynamic
    per-token activations, LM head float), bf16 like llm-compressor's output for this bf16 model:
    kvflow/model/quant/compressed_tensors_export.py. vLLM and kvflow both serve it."""
    if os.path.isfile(os.path.join(out_dir, ".complete")):
        return out_dir
    sys.path.insert(0, ROOT)
    import torch

    from kvflow.model.quant.compressed_tensors_export import export

    export(export_hf_folder(hf_dir), out_dir, dtype=torch.bfloat16)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir


def convert_script() -> str | None:
    sdist = os.path.join(LLAMACPP_VENV, "sdist", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
    script = os.path.join(sdist, "convert_hf_to_gguf.py")
    return script if os.path.isfile(script) else None


def export_gguf(outtype: str = "f32", hf_dir: str = HF_DIR) -> str:
    """llama.cpp's GGUF of the HF folder (outtype f32 | bf16 | f16), converted once (per
    folder: the bf16 folder's f32 GGUF holds the bf16 values, widened)."""
    tag = "" if os.path.normpath(hf_dir) == os.path.normpath(HF_DIR) else "-from-" + os.path.basename(os.path.normpath(hf_dir))
    out = os.path.join(RESULTS, f"smollm2-135m-instruct-{outtype}{tag}.gguf")
    if os.path.isfile(out):
        return out
    script = convert_script()
    if script is None:
        raise RuntimeError("convert_hf_to_gguf.py not found: run benchmarks/setup_anchors.sh llamacpp")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(script), "gguf-py"))
    tmp = out + ".tmp"
    subprocess.run([os.path.join(LLAMACPP_VENV, "bin", "python"), script, hf_dir,
                    "--outtype", outtype, "--outfile", tmp], check=True, env=env,
                   capture_output=True, text=True)
    os.replace(tmp, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", action="store_true", help="also convert to GGUF (f32, bf16) for llama.cpp")
    p.add_argument("--w8a8", action="store_true", help="also write the int8 W8A8 compressed-tensors folder")
    args = p.parse_args()
    print(export_hf_folder())
    if args.w8a8:
        print(export_w8a8())
    if args.gguf:
        for t in ("f32", "bf16"):
            print(export_gguf(t))


if __name__ == "__main__":
    main()
