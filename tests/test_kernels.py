"""The Triton kernels, run by Triton's CPU interpreter against their PyTorch references, so that CI
(which has no GPU) checks the same kernel code the GPU runs. test_cuda.py runs them for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")


def test_paged_attention_kernel_in_the_interpreter():
    script = Path(__file__).with_name("paged_attention_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(script), "30"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "30 cases agree" in proc.stdout


def test_mla_attention_kernel_in_the_interpreter():
    """Absorbed MLA over the paged latent cache (decode, verify and prefill chunks over cached prefixes;
    head counts that are not powers of two; DeepSeek's 512 + 64 row)."""
    script = Path(__file__).with_name("mla_attention_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(script), "12"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 cases agree" in proc.stdout
