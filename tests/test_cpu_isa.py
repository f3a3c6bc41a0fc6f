"""KVFLOW_CPU_ISA: an AVX-512 machine run as the AVX2-only kind (or as AVX-512 without BF16/AMX),
its flags, its kernel build and PyTorch's kernels capped together."""
import json
import os
import subprocess
import sys

import pytest

from kvflow.utils import cpuinfo
from kvflow.utils.cpuinfo import mask_flags

ZEN4 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                  "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "avx_vnni"})


def test_avx2_keeps_the_avx2_kind_flags_only():
    assert mask_flags(ZEN4, "avx2") == {"sse4_2", "avx", "avx2", "fma", "f16c"}


def test_avx512_drops_bf16_and_amx_only():
    assert mask_flags(ZEN4, "avx512") == ZEN4 - {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}


def test_no_cap_changes_nothing():
    assert mask_flags(ZEN4, None) == ZEN4


@pytest.mark.parametrize("cap,march", [(None, ["-march=native"]), ("", ["-march=native"]),
                                       ("avx2", ["-march=x86-64-v3"])])
def test_build_flags_follow_the_cap(monkeypatch, cap, march):
    import kvflow.csrc as c

    if cap is None:
        monkeypatch.delenv("KVFLOW_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("KVFLOW_CPU_ISA", cap)
    flags = c._build_flags()
    assert [f for f in flags if f.startswith("-march")] == march
    assert flags[0] == "-O3" and "-shared" in flags


def test_avx512_build_flags_keep_native_without_bf16_or_amx(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_ISA", "avx512")
    flags = cpuinfo.march_flags()
    assert flags[0] == "-march=native" and {"-mno-avx512bf16", "-mno-amx-tile"} <= set(flags)


def _unset_torch_caps(monkeypatch) -> None:
    """Both torch variables unset for the test and as they were after it (a bare delenv of an
    unset variable would not undo what the test then sets: later tests' subprocesses would
    inherit the cap)."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_unknown_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="KVFLOW_CPU_ISA='avx9'"):
        cpuinfo.cpu_isa_cap()
    _unset_torch_caps(monkeypatch)
    cpuinfo.cap_torch_kernels()  # leaves it to read_cpuinfo's refusal: sets nothing
    assert "ATEN_CPU_CAPABILITY" not in os.environ and "ONEDNN_MAX_CPU_ISA" not in os.environ


def test_a_cap_sets_torch_and_onednn_unless_set(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_ISA", "avx2")
    _unset_torch_caps(monkeypatch)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    cpuinfo.cap_torch_kernels()
    assert (os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "SSE41")


CHECK = """
import json
import kvflow, torch
import kvflow.csrc as c
from kvflow.model.cpu_features import cpu_features
from kvflow.model.loader import resolve_dtype
from kvflow.model.quant.qlinear import available_isas
from kvflow.utils.cpuinfo import read_cpuinfo
lib = c.library()
print(json.dumps({"name": read_cpuinfo().model_name, "isa": cpu_features().isa,
                  "avx512": any(f.startswith("avx512") for f in read_cpuinfo().flags),
                  "torch": torch.backends.cpu.get_cpu_capability(), "quant": available_isas(),
                  "q8_isas": lib.paged_decode_q8_isas(), "dtype": str(resolve_dtype("auto"))}))
"""


@pytest.mark.slow  # builds the kernel library again (~12 s)
def test_avx2_cap_end_to_end(tmp_path):
    """Under KVFLOW_CPU_ISA=avx2, on either kind of CPU: kvflow sees an AVX2 CPU, its kernels
    are built without AVX-512 (the quantized GEMM and the one-byte caches' decode offer scalar
    and AVX2 only), PyTorch's dispatch is capped at AVX2, and `auto` computes in fp32."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update(KVFLOW_CPU_ISA="avx2", KVFLOW_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["name"].endswith(" as avx2 (KVFLOW_CPU_ISA)")
    assert (res["isa"], res["avx512"], res["torch"]) == ("avx2", False, "AVX2")
    assert res["quant"] == ["scalar", "avx2"]
    assert res["q8_isas"] == 0b11  # scalar and AVX2 rows, no AVX-512 or AVX512-BF16 one
    assert res["dtype"] == "torch.float32"


HF_CHECK = """
import json, sys
import kvflow
import torch
sys.path.insert(0, sys.argv[1])
from conftest import NEW_TOKENS, PROMPTS, assert_matches_reference, hf_greedy_reference
from kvflow import LLM, SamplingParams
from kvflow.model_path import default_model_path
from kvflow.tokenizer import get_tokenizer
path = default_model_path()
ids = [get_tokenizer(path).encode(p) for p in PROMPTS]
ref = hf_greedy_reference(path, ids, torch.float32)
llm = LLM(path, dtype="auto", quantization="none", max_model_len=1024, num_blocks=256,
          max_num_batched_tokens=64)
outs = llm.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
for i, out in enumerate(outs):
    assert_matches_reference(out.outputs[0].token_ids, ref[i], f"prompt {i}")
model = llm.engine.core.executor.runner.model
print(json.dumps({"dtype": str(model.dtype), "kernels": model.kernels.names,
                  "identical": sum(o.outputs[0].token_ids == ref[i][0] for i, o in enumerate(outs))}))
"""


@pytest.mark.slow  # HF's reference and the engine on the default model (~45 s)
def test_avx2_kind_generates_hfs_greedy_tokens(tmp_path):
    """The whole model path of the AVX2 kind (fp32 activations, the AVX2 fp32 GEMV, attention,
    norms and RoPE built without AVX-512), on whatever CPU runs the tests: greedy tokens equal
    to HF transformers' fp32 on the default model's nine prompts, all at once with chunked
    prefill."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update(KVFLOW_CPU_ISA="avx2", KVFLOW_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", HF_CHECK, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["dtype"] == "torch.float32"
    assert res["kernels"]["linear"] == "gemv-avx2" and res["kernels"]["attention"] == "c-decode"
    assert res["identical"] >= 7, res  # fp32 ties may excuse a divergence, not most of them


@pytest.mark.slow  # builds the kernel library again (~12 s)
def test_avx2_build_prompt_tiles_give_the_rows_numbers(tmp_path):
    """The AVX2-only build (the Zen 3 kind's) runs the prompt tiles: each token's numbers
    equal its own row's bit for bit and SDPA's closely, fp32 and bf16 caches, 1 and 2
    threads."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update(KVFLOW_CPU_ISA="avx2", KVFLOW_CACHE_DIR=str(tmp_path))
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(tests, "test_cpu_kernels.py"), "-k",
                          "avx2_tiles and 9-3-64 or chunks"], env=env, cwd=os.path.dirname(tests),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "5 passed" in out.stdout, out.stdout[-500:]
