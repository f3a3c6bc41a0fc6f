"""Each layer imports only from the layers below it (or its own), read from the source with `ast`,
imports inside functions included; `kvflow.core` never loads torch.

The layers, bottom to top:

    leaf         config, options, envs, logger, sampling_params, pooling_params, request,
                 outputs, model_path, utils/, lora_request, the model registry
                 (models/registry.py: architecture names -> family modules, loaded by name)
                 and the package's __init__: plain types and settings, no torch
    core/        scheduling bookkeeping; no torch (checked below), testable without a model
    csrc/        the compiled kernels and their torch wrappers
    attention/   attention over the paged KV cache: its layout, the step's metadata, the KV
                 write, the backends (C kernels, SDPA) and the selector that picks them once
    checkpoint/  formats -> named tensors: an HF folder's files, GGUF files and their block formats,
                 compressed-tensors checkpoints, the GGUF conversion cache; with them the model/
                 files they read through, which import nothing above: arch.py (the architecture
                 from config.json or GGUF metadata, with attention_pattern.py) and
                 quant/packing.py (the q4/q8 values GGUF blocks decode to)
    model/       torch: loading weights, the kernels, the KV cache's memory, sampling, the executor
    worker/      one layer with model/: the ModelRunner (model/'s executor and draft proposer
                 import it)
    layers/      what model families share: the attention layer, RoPE, the expert block, the
                 short convolution, weights
    models/      one file per model family: its config fields, weight names, module, supports
    distributed/ tensor parallelism: the process group, workers and the TPExecutor
    kv_transfer/ prefill/decode disaggregation: the lease table, the wire messages and the
                 agent thread that lends and pulls KV blocks (its `params` module, the request
                 field, is a plain leaf type)
    structured/  structured outputs: grammar backends, compiling off the loop, batch masks
                 (given a tokenizer, never loading one itself)
    multimodal/  images: reading and bounding their sources, a model's image processing (its
                 `inputs` module, the decoded ImageItem a request carries, is a plain leaf type)
    engine/      EngineCore and its process, the wire protocol, detokenizing; tokenizer.py
                 sits here too (only the engine and above turn text into ids)
    trace/       reading and explaining the engine's step trace
    entrypoints/ LLM, the CLI and the OpenAI server
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvflow"

LAYERS = [
    ("leaf", ["kvflow", "kvflow.config", "kvflow.options", "kvflow.envs", "kvflow.logger",
              "kvflow.sampling_params", "kvflow.request", "kvflow.outputs", "kvflow.model_path",
              "kvflow.utils", "kvflow.kv_transfer.params", "kvflow.pooling_params",
              "kvflow.lora_request", "kvflow.models.registry", "kvflow.multimodal.inputs"]),
    ("core", ["kvflow.core"]),
    ("csrc", ["kvflow.csrc"]),
    ("attention", ["kvflow.attention"]),
    ("checkpoint", ["kvflow.checkpoint", "kvflow.model.arch", "kvflow.model.attention_pattern",
                    "kvflow.model.quant.packing"]),
    ("model", ["kvflow.model", "kvflow.worker"]),
    ("layers", ["kvflow.layers"]),
    ("models", ["kvflow.models"]),
    ("distributed", ["kvflow.distributed"]),
    ("kv_transfer", ["kvflow.kv_transfer"]),
    ("structured", ["kvflow.structured"]),
    ("multimodal", ["kvflow.multimodal"]),
    ("engine", ["kvflow.engine", "kvflow.tokenizer", "kvflow.chat_templates"]),
    ("trace", ["kvflow.trace"]),
    ("entrypoints", ["kvflow.entrypoints"]),
]

# Imports that point upward on purpose, each with its reason.
ALLOWED_UPWARD = {
    ("kvflow", "kvflow.entrypoints.llm"): "`kvflow.LLM`, the public API, imported only when asked for",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix that names `module` (or its package)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def kvflow_imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported kvflow module, line) for every import in the file, at any depth."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                # `from kvflow.model import hugepages` imports the module kvflow.model.hugepages
                sub = f"{base}.{a.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return [(m, line) for m, line in found if m == "kvflow" or m.startswith("kvflow.")]


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, f"place these modules in a layer of LAYERS: {unplaced}"


def test_each_layer_imports_only_from_below():
    offences = []
    for module, path in MODULES.items():
        own = layer_of(module)
        for target, line in kvflow_imports(module, path):
            theirs = layer_of(target)
            if theirs is None or own is None or theirs <= own:
                continue
            if (module, target) in ALLOWED_UPWARD:
                continue
            offences.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[own][0]}) "
                            f"imports {target} ({LAYERS[theirs][0]})")
    assert not offences, "imports from a layer above:\n" + "\n".join(offences)


def test_the_layer_check_names_an_upward_import(tmp_path):
    """The walk sees imports inside functions, and relative ones."""
    src = tmp_path / "kvflow" / "model" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from kvflow.engine.protocol import EngineCoreRequest\n"
                   "from ..engine import core\n")
    found = kvflow_imports("kvflow.model.x", src)
    assert ("kvflow.engine.protocol", 2) in found and ("kvflow.engine.core", 3) in found
    assert all(layer_of(m) > layer_of("kvflow.model.x") for m, _ in found)


def import_cycles() -> list[list[str]]:
    """Groups of modules that import each other (strongly connected, imports in functions
    included), Tarjan's algorithm."""
    graph = {m: {t for t, _ in kvflow_imports(m, p)
                 if t in MODULES and t != m and (m, t) not in ALLOWED_UPWARD}
             for m, p in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"modules that import each other: {cycles}"


def test_core_never_imports_torch():
    """Neither a file under kvflow/core nor anything it pulls in loads torch."""
    core = sorted(m for m in MODULES if layer_of(m) == layer_of("kvflow.core"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core)
            + "heavy = [m for m in ('torch', 'numpy', 'transformers', 'fastapi') if m in sys.modules]\n"
            + "assert 'torch' not in sys.modules, heavy\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("module", ["kvflow.engine.core_client", "kvflow.engine.async_engine",
                                    "kvflow.engine.protocol"])
def test_frontend_modules_do_not_load_torch(module):
    """The server's frontend process speaks the protocol without loading the model's stack."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = f"import sys, {module}\nassert 'torch' not in sys.modules\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_benchmark_prompts_import_in_another_engines_venv():
    """benchmarks/ workers run in llama.cpp's and vLLM's venvs, which lack kvflow's packages:
    W1's prompts and the package's __init__ import the standard library only."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = ("import sys\n"
            "for name in ('msgspec', 'numpy', 'torch', 'pydantic', 'zmq'):\n"
            "    sys.modules[name] = None  # importing any of these now fails\n"
            "from kvflow.utils.w1_prompts import make_w1\n"
            "prompts = make_w1(4, 2, 5, 1000, 0)\n"
            "assert len(prompts) == 4 and all(2 <= len(p) <= 5 for p in prompts), prompts\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
