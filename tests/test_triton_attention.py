"""The Triton paged-attention kernels, checked on CPU through Triton's interpreter: the checks
live in triton_kernel_checks.py and run in a fresh process with TRITON_INTERPRET=1, since the
interpreter must be on before triton is first imported (xgrammar imports it elsewhere in the
suite)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent


def test_triton_kernels_match_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNEL_CHECKS_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "triton_kernel_checks.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 30, proc.stdout[-2000:]
