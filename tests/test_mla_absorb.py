"""MLA's absorbed products (kernels/mla_absorb.py): the Triton kernels in Triton's CPU interpreter against the batched
matmul (float64, rounded once); on CUDA the same cases in tests/test_deepseek_cuda.py, and the models with the knob
there. The layer's path with the knob off is the batched matmul itself (tests/test_deepseek.py against
transformers)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_triton_interpreter

from atlas.kernels import settings
from atlas.kernels.mla_absorb import absorb_query, absorb_query_ref, expand_values, expand_values_ref


def test_absorbed_product_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    out = run_in_triton_interpreter("mla_absorb_cases.py", "4")
    assert "4 cases agree" in out, out


def test_the_public_functions_take_the_reference_off_cuda():
    """On the CPU (and with the knob off anywhere) the layer's products are the batched matmul, laid out for the
    attention kernel ([T, H, L]) and o_proj ([T, H * V])."""
    from mla_absorb_cases import case

    c = case(1, "cpu", torch.float32)
    with settings.tuned(mla_absorb_gemv=True):
        q, v = absorb_query(c["q_nope"], c["w_uk"]), expand_values(c["o_latent"], c["w_uv"])
    t, h, _ = c["q_nope"].shape
    assert q.shape == (t, h, c["w_uk"].shape[2]) and v.shape == (t, h * c["w_uv"].shape[1])
    assert torch.equal(q, absorb_query_ref(c["q_nope"], c["w_uk"]))
    assert torch.equal(v, expand_values_ref(c["o_latent"], c["w_uv"]))
    want = torch.einsum("thl,hvl->thv", c["o_latent"].double(), c["w_uv"].double()).reshape(t, -1)
    torch.testing.assert_close(v.double(), want, rtol=1e-5, atol=1e-5)
