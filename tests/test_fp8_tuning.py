"""The FP8 linear layers' table of tuned choices (kernels/fp8_linear.py) and `atlas bench fp8`'s picking from measured
times, on CPU: the table's entries parse, row counts find their entry, cuBLASLt's block-scaled matmul gets the layouts
torch._scaled_mm checks (on the meta device), and a report's suggestions are the fastest candidates. (The kernels
themselves: fp8_linear_cases.py, in the interpreter and on CUDA.)"""

from __future__ import annotations

import pytest
import torch

from atlas.bench import fp8 as bench
from atlas.kernels import fp8_linear as f
from atlas.kernels.fused_ops import act_and_mul_ref
from atlas.kernels.gemv import GemvConfig


def test_the_table_parses_and_row_counts_take_the_next_entry_up(monkeypatch):
    for text in [*f.GEMV_CONFIGS.values(), *f.GEMV_SHAPE_CONFIGS.values(), f.W8A16_CONFIG]:
        assert str(f.parse_config(text)) == text
    assert f.parse_tile(f.BLOCK_GEMM_TILE)["block_m"] > 0 and f.BLOCK_LARGE_M in ("scaled_mm", "triton")
    assert f.parse_config("sum-n4k2048w4s3") == GemvConfig(4, 2048, 4, 3, "sum")
    assert f.parse_config("rt-n4k2048w4s1") == GemvConfig(4, 2048, 4, 1, "rt")
    assert f.parse_tile("m128n64w8s4g8") == dict(block_m=128, block_n=64, num_warps=8, num_stages=4, group_m=8)
    with pytest.raises(ValueError, match="kind-nNkKwWsS"):
        f.parse_config("sum-4-2048")
    for bad, why in (("rt-n3k2048w4s1", "n 1, 2 or 4"), ("rt-n4k8w4s1", "at least 16"),
                     ("sum-n4k2000w4s3", "powers of two"), ("rt-n4k2048w3s1", "powers of two"),
                     ("xs-n8k128w4s0", "s at least 1")):
        with pytest.raises(ValueError, match=why):
            f.parse_config(bad)
    monkeypatch.setattr(f, "GEMV_CONFIGS", {1: "sum-n4k2048w4s3", 4: "sum-n4k512w4s3", 8: "dot-n16k128w4s4"})
    monkeypatch.setattr(f, "GEMV_SHAPE_CONFIGS", {(4, 6144, 4096): "sum-n2k1024w8s3"})
    assert str(f.small_m_config(1, 10, 10)) == "sum-n4k2048w4s3"
    assert str(f.small_m_config(3, 10, 10)) == "sum-n4k512w4s3"
    assert str(f.small_m_config(3, 6144, 4096)) == "sum-n2k1024w8s3"
    assert str(f.small_m_config(5, 6144, 4096)) == "dot-n16k128w4s4"
    assert f.small_m_config(9, 10, 10) is None


def test_the_fp8_gemv_tuning_knob_replaces_the_table_and_bad_values_are_refused(monkeypatch):
    from atlas.config import TuningConfig
    from atlas.errors import ConfigError
    from atlas.kernels import settings

    monkeypatch.setattr(f, "GEMV_SHAPE_CONFIGS", {(1, 6144, 4096): "sum-n2k1024w8s3"})
    monkeypatch.setattr(settings, "tuning", TuningConfig(fp8_gemv="1:xs-n8k128w4s4; 8:dot-n16k128w4s4"))
    assert str(f.small_m_config(1, 6144, 4096)) == "xs-n8k128w4s4"  # (the knob's, not the table's shape entry)
    assert str(f.small_m_config(2, 6144, 4096)) == "dot-n16k128w4s4"
    assert f.small_m_config(9, 10, 10) is None
    for bad, why in (("1:xs-8", "ROWS:CONFIG"), ("one:xs-n8k128w4s4", "ROWS:CONFIG"), ("65:xs-n8k128w4s4", "1..64")):
        with pytest.raises(ConfigError, match=why):
            settings.set_kernel_settings(TuningConfig(fp8_gemv=bad))
    assert settings.tuning.fp8_gemv.startswith("1:xs")  # (a refused value changed nothing)
    # (w8a8: those row counts take the large-M path, activations quantized)
    monkeypatch.setattr(settings, "tuning", TuningConfig(fp8_gemv="1:sum-n4k2048w4s3;64:w8a8"))
    assert str(f.small_m_config(16, 6144, 4096)) == "w8a8"


def test_blockwise_scaled_mm_takes_the_layouts_scaled_mm_checks():
    """On the meta device torch._scaled_mm checks the shapes of its 1x128 / 128x128 block scales: M padded to 4,
    activations' scales [M, K / 128] (M-major), the weight's [N / 128, K / 128] transposed."""
    x = torch.empty(50, 512, device="meta", dtype=torch.bfloat16)
    w = torch.empty(256, 512, device="meta", dtype=f.FP8)
    s = torch.empty(2, 4, device="meta")
    assert f.blockwise_scaled_mm_fits(x, w, s, (128, 128), probe=False)
    y = f.blockwise_scaled_mm(x, w, s)
    assert y.shape == (50, 256) and y.dtype == torch.bfloat16
    # what it does not take: other blocks, other dtypes, K / 128 not a multiple of 4 (the scales' 16-byte stride)
    assert not f.blockwise_scaled_mm_fits(x, w, s, (64, 64), probe=False)
    assert not f.blockwise_scaled_mm_fits(x.float(), w, s, (128, 128), probe=False)
    w6 = torch.empty(256, 768, device="meta", dtype=f.FP8)
    assert not f.blockwise_scaled_mm_fits(x, w6, torch.empty(2, 6, device="meta"), (128, 128), probe=False)
    assert not f.blockwise_scaled_mm_fits(x, w, s, None, probe=False)


def test_the_activation_is_applied_off_cuda_too():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 48, generator=g) * 50).to(f.FP8)
    s = torch.rand(32, generator=g) / 100
    x = torch.randn(3, 48, generator=g)
    want = act_and_mul_ref(f.fp8_linear_ref(x, w, s, None))
    assert torch.equal(f.fp8_linear(x, w, s, None, act="silu"), want)


def test_gemv_candidates_keep_their_tiles_in_registers():
    for rows in (1, 2, 4, 8):
        cands = bench.gemv_candidates(rows)
        pad = 1 << (rows - 1).bit_length()
        assert cands and len(set(cands)) == len(cands)
        assert all(c.kind != "sum" or pad * c.block_n * c.block_k <= 16384 for c in cands)
        assert any(c.kind == "dot" for c in cands) and any(c.kind == "sum" for c in cands)


def _gemv_report():
    def cell(n, k, us, err=None):
        best = min(us, key=us.__getitem__)
        return {"N": n, "K": k, "us": us, "max_err": err or {}, "best": best, "best_us": us[best],
                "roofline_us": 10.0, "bf16_cublas_us": 30.0}

    a, b, c = "sum-n4k2048w4s3", "sum-n8k1024w4s3", "dot-n16k128w4s4"
    return {"rows": {
        "1": {"qkv": cell(6144, 4096, {a: 12.0, b: 13.0, c: 20.0}),
              "down": cell(4096, 12288, {a: 20.0, b: 15.0, c: 30.0})},
        # a faster config whose result is wrong is not chosen
        "2": {"qkv": cell(6144, 4096, {a: 14.0, b: 5.0, c: 13.0}, {b: 0.5}),
              "down": cell(4096, 12288, {a: 22.0, b: 5.0, c: 21.0}, {b: 0.5})},
    }, "errors": [], "skipped": []}


def test_suggestions_from_a_gemv_report():
    s = bench.suggest_gemv(_gemv_report())
    # rows 1: b's total 28 beats a's 32; qkv's own best (a, 12) beats b's 13 by more than the margin
    assert s["GEMV_CONFIGS"] == {1: "sum-n8k1024w4s3", 2: "dot-n16k128w4s4"}
    assert s["GEMV_SHAPE_CONFIGS"] == {"(1, 6144, 4096)": "sum-n4k2048w4s3"}


def test_suggestions_from_a_gemm_report_and_the_summary():
    t0, t1 = bench.GEMM_TILES[:2]

    def cell(us):
        return {"N": 4096, "K": 4096, "us": us, "TFLOPS": {}, "max_rel_err": {}}

    report = {"M": {
        "64": {"o": cell({"w8a16": 10.0, f"triton_w8a8_{t0}": 12.0, f"triton_w8a8_{t1}": 11.0,
                          "scaled_mm_blockwise": 14.0, "bf16_matmul": 9.0})},
        "256": {"o": cell({"w8a16": 30.0, f"triton_w8a8_{t0}": 25.0, f"triton_w8a8_{t1}": 20.0,
                           "scaled_mm_blockwise": 15.0, "bf16_matmul": 22.0,
                           "quant_groups_triton": 2.0, "quant_groups_torch": 9.0})},
    }, "errors": [], "skipped": [], "blockwise_probe": {"ok": True}}
    s = bench.suggest_gemm(report)
    assert s["BLOCK_GEMM_TILE"] == t1 and s["BLOCK_LARGE_M"] == "scaled_mm" and s["SMALL_M"] == 64
    report["suggest"] = s
    gv = _gemv_report()
    gv["suggest"] = bench.suggest_gemv(gv)
    text = bench.summary(gv, report)
    assert 'GEMV_CONFIGS: dict[int, str] = {1: "sum-n8k1024w4s3", 2: "dot-n16k128w4s4"}' in text
    assert f"BLOCK_GEMM_TILE = '{t1}'" in text and "BLOCK_LARGE_M = 'scaled_mm'" in text
    assert "quant triton 2 vs torch 9" in text
    # the printed block is Python that sets the table
    table = {}
    exec("\n".join(line for line in text.splitlines() if line[:1].isupper()), {}, table)  # noqa: S102
    assert table["GEMV_CONFIGS"] == {1: "sum-n8k1024w4s3", 2: "dot-n16k128w4s4"}
    assert table["GEMV_SHAPE_CONFIGS"] == {(1, 6144, 4096): "sum-n4k2048w4s3"}
