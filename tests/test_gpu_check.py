"""benchmarks/gpu_check.py, the one script a GPU machine runs: it starts on a CPU, its roofline
arithmetic gives the known figures for Llama-3-8B on an H200, and its whole run (tiny shapes,
Triton's interpreter, CUDA graphs off) passes in a dry run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_gpu_check_helps_and_refuses_without_a_gpu_unless_dry_run():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "H200" in proc.stdout
    import torch
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(SCRIPT), "--skip", "kernels"], capture_output=True,
                              text=True, env=_env(), timeout=120)
        assert proc.returncode == 2 and "no GPU visible to torch" in proc.stderr


@pytest.fixture(scope="module")
def llama3_8b_arch(tmp_path_factory):
    from transformers import LlamaConfig

    import gpu_check
    from kvflow.model.arch import load_arch_config
    path = tmp_path_factory.mktemp("llama3-8b")
    LlamaConfig(**gpu_check.SHAPES["llama3-8b"]).save_pretrained(path)
    return load_arch_config(str(path))


def test_roofline_figures_for_llama3_8b_on_an_h200(llama3_8b_arch):
    import gpu_check
    arch = llama3_8b_arch
    assert 7.4e9 < arch.num_parameters() < 8.2e9
    weight_bytes = 2 * arch.num_parameters()
    # batch 1: ~16 GB of weights per token at 4.3 TB/s is ~270 tokens/s
    limit = gpu_check.bandwidth_limit_batch1(arch, weight_bytes, 128, 256, 2, 4.3e12)
    assert 250 < limit < 275
    # W1: ~49k tokens through 8B parameters is ~0.9 s of bf16 FLOPs at 790 TFLOP/s, more than
    # reading the weights 128 times (~0.5 s): compute-bound
    prompts = gpu_check.w1_prompts(128, 32, 512, arch.vocab_size, 0)
    roof = gpu_check.roofline_w1(arch, weight_bytes, list(map(len, prompts)), 128, 2, 4.3e12, 790e12)
    assert roof["bound"] == "compute" and 12_000 < roof["output_tok_s"] < 25_000


@pytest.mark.slow
def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--skip", "kernels",
                           "--out", str(out)], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (model,) = report["models"]
    assert model["equivalence"]["ok"] and model["equivalence"]["tokens"] == 32
    assert model["engine_core"]["ok"] and "blocks x 16" in model["engine_core"]["startup_report"]
    assert model["w1"]["kvflow_output_tok_s"] > 0 and model["w1"]["hf_output_tok_s"] > 0
    assert model["batch1"]["kvflow_decode_tok_s"] > 0 and model["batch1"]["kvflow_eager_decode_tok_s"] > 0
    assert "greedy vs HF: PASS" in proc.stdout
