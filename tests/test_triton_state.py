"""The Triton state kernels (conv, one-token updates, prompt scans), checked on CPU through Triton's interpreter in a fresh process
(triton_state_checks.py), as the attention kernels are (test_triton_attention.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent


def test_triton_state_kernels_match_the_layers_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNEL_CHECKS_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "triton_state_checks.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 27, proc.stdout[-2000:]
