"""The Triton kernels, run by Triton's CPU interpreter against their PyTorch references, so that CI
(which has no GPU) checks the same kernel code the GPU runs. test_cuda.py runs them for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]


def _interpreter_env() -> dict:
    # The scripts import atlas from this checkout, not whichever copy is installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}


def test_paged_attention_kernel_in_the_interpreter():
    """All step kinds unsplit (30 cases), then decode steps through split-KV and the combine kernel
    (16 cases: 2 to 32 splits, some of them empty; GQA groups, page sizes, windows)."""
    script = Path(__file__).with_name("paged_attention_cases.py")
    proc = subprocess.run([sys.executable, str(script), "30", "16"], capture_output=True, text=True,
                          env=_interpreter_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "30 cases agree" in proc.stdout
    assert "16 split-KV cases agree" in proc.stdout


def test_gemv_kernel_in_the_interpreter():
    """y = x @ W^T for M = 1..8, N and K off the block sizes, with and without bias, every config."""
    script = Path(__file__).with_name("gemv_cases.py")
    proc = subprocess.run([sys.executable, str(script), "24"], capture_output=True, text=True,
                          env=_interpreter_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "24 GEMV cases agree" in proc.stdout


def test_mla_attention_kernel_in_the_interpreter():
    """Absorbed MLA over the paged latent cache (decode, verify and prefill chunks over cached prefixes;
    head counts that are not powers of two; DeepSeek's 512 + 64 row)."""
    script = Path(__file__).with_name("mla_attention_cases.py")
    proc = subprocess.run([sys.executable, str(script), "12"], capture_output=True, text=True,
                          env=_interpreter_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 cases agree" in proc.stdout


def test_token_mask_kernel_in_the_interpreter():
    """Grammar bitmasks on float32 logits, against the sampler's PyTorch path: vocabularies off 32 and off
    the block, bitmasks narrower than the vocabulary, every row or a subset in any order, rows with every
    token masked and rows whose allowed tokens are all -inf already (the fallback)."""
    script = Path(__file__).with_name("token_mask_cases.py")
    proc = subprocess.run([sys.executable, str(script), "24"], capture_output=True, text=True,
                          env=_interpreter_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "24 cases agree" in proc.stdout


def test_split_count_depends_on_the_program_count_only():
    from atlas.kernels.paged_attention import MAX_KV_SPLITS, num_kv_splits

    # batch 1 of a model with 8 KV heads on 132 SMs: 8 programs -> 32 splits (256 programs)
    assert num_kv_splits(1, 8, 132) == MAX_KV_SPLITS == 32
    assert [num_kv_splits(b, 8, 132) for b in (2, 4, 8, 16, 17, 32, 256)] == [16, 8, 4, 2, 1, 1, 1]
    assert num_kv_splits(3, 8, 132) == 8  # powers of two (the combine kernel reads them as one tile)
    assert num_kv_splits(1, 1, 4) == 8
