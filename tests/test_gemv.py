"""The small-M GEMV's registry (kernels/gemv.py): which kernel a weight shape gets from measured
times under the gemv tuning knob (auto / 0 / 1), and that `linear` stays F.linear off CUDA. The kernel
itself is checked in test_kernels.py (interpreter) and test_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atlas.config import TuningConfig
from atlas.errors import ConfigError
from atlas.kernels import gemv
from atlas.kernels.gemv import CONFIGS, GemvConfig, decide
from atlas.layers.embedding import linear_weights

A, B, C = CONFIGS[:3]


@pytest.fixture(autouse=True)
def clean_registry():
    gemv.reset()
    yield
    gemv.reset()


def test_auto_takes_the_fastest_gemv_only_when_it_beats_cublas():
    assert decide({"cublas": 15.6, A: 12.0, B: 11.0, C: 13.0}, "auto") == B
    assert decide({"cublas": 10.0, A: 12.0, B: 11.0}, "auto") is None
    # a near tie (within the margin) stays with cuBLAS
    assert decide({"cublas": 10.0, A: 9.9}, "auto") is None
    assert decide({"cublas": 10.0, A: 10.0 * gemv.AUTO_MARGIN * 0.99}, "auto") == A
    assert decide({"cublas": 10.0}, "auto") is None


def test_mode_zero_and_one():
    times = {"cublas": 5.0, A: 12.0, B: 11.0}
    assert decide(times, "0") is None
    assert decide({"cublas": 50.0, A: 1.0}, "0") is None
    assert decide(times, "1") == B  # forced on: the best GEMV, however slow


def test_mode_from_the_config():
    assert TuningConfig().gemv == "default"  # (the GEMV on compute capability 9.0+, cuBLAS elsewhere)
    for value in ("0", "1", "auto", "AUTO", "default", 0, 1):
        assert TuningConfig(gemv=value).gemv == str(value).lower()
        assert TuningConfig.parse(f"gemv={value}").gemv == str(value).lower()
    with pytest.raises(ConfigError, match="tuning gemv must be one of default, 0, 1, auto"):
        TuningConfig(gemv="yes")
    with pytest.raises(ValueError, match="GEMV mode"):
        gemv.tune_shapes(linear_weights(torch.nn.Sequential()), "yes")


def test_the_rows_knob_names_a_dot_tile_by_row_count_and_bad_values_are_refused(monkeypatch):
    """gemv_rows: a verify step's (or a small batch's) rows through the tensor-core GEMV by row count, the next key
    up; one row keeps the single-row registry; a value that is not ROWS:dot-nNkKwWsS is refused at start-up, and a
    refused value changes nothing."""
    from atlas.kernels import settings

    text = "8:dot-n16k256w4s4; 16:dot-n32k128w4s6"
    assert gemv.parse_rows_table(text) == {8: GemvConfig(16, 256, 4, 4, "dot"), 16: GemvConfig(32, 128, 4, 6, "dot")}
    assert gemv.rows_choice(1, text) is None
    assert gemv.rows_choice(2, text) == gemv.rows_choice(8, text) == GemvConfig(16, 256, 4, 4, "dot")
    assert gemv.rows_choice(9, text) == gemv.rows_choice(16, text) == GemvConfig(32, 128, 4, 6, "dot")
    assert gemv.rows_choice(17, text) is None and gemv.rows_choice(8, "") is None
    monkeypatch.setattr(settings, "tuning", TuningConfig())
    for bad, why in (("8:sum-n4k2048w4s3", "ROWS:dot"), ("eight:dot-n16k256w4s4", "ROWS:dot"),
                     ("1:dot-n16k256w4s4", "2..16"), ("32:dot-n16k256w4s4", "2..16"),
                     ("8:dot-n8k256w4s4", "powers of two from 16"), ("8:dot-n16k200w4s4", "powers of two from 16")):
        with pytest.raises(ConfigError, match=why):
            settings.set_kernel_settings(TuningConfig(gemv_rows=bad))
    assert settings.tuning.gemv_rows == ""
    # (off CUDA the knob changes nothing: F.linear)
    settings.set_kernel_settings(TuningConfig(gemv_rows=text))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 40, generator=g), torch.randn(24, 40, generator=g)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def test_registry_records_choices_per_shape_and_dtype():
    bf16 = torch.bfloat16
    measured = {(4096, 4096, bf16): {"cublas": 10.9, A: 8.0, B: 8.5},
                (24576, 4096, bf16): {"cublas": 50.0, A: 55.0, B: 54.0},
                (6144, 4096, bf16): {"cublas": 15.6, A: 13.0, B: 12.5}}
    gemv.record({shape: decide(t, "auto") for shape, t in measured.items()}, "auto")
    assert gemv.choice(4096, 4096, bf16) == A
    assert gemv.choice(6144, 4096, bf16) == B
    assert gemv.choice(24576, 4096, bf16) is None
    assert gemv.choice(4096, 4096, torch.float16) is None  # another dtype was not measured
    assert gemv.choice(1000, 4096, bf16) is None

    gemv.record({shape: decide(t, "1") for shape, t in measured.items()}, "1")
    assert gemv.choice(24576, 4096, bf16) == B
    assert gemv.choice(1000, 4096, bf16) == gemv.DEFAULT_CONFIG  # forced: shapes never measured too

    gemv.record({shape: decide(t, "0") for shape, t in measured.items()}, "0")
    assert all(gemv.choice(*shape) is None for shape in measured)


def test_linear_is_f_linear_off_cuda_whatever_the_registry():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    gemv.record({(24, 40, torch.float32): GemvConfig(16, 256)}, "1")
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def test_a_widened_linear_is_f_linear_of_the_cast_row_off_cuda():
    """linear_widened (the float32 routers' logits from a bf16 row) is F.linear(x.float(), W) off CUDA, any rows;
    on CUDA the GEMV's widening load is checked bit for bit against the cast (gemv_cases.py)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 40, generator=g).to(torch.bfloat16), torch.randn(24, 40, generator=g)
    gemv.record({(24, 40, torch.float32): GemvConfig(4, 2048, 4, 3, "sum")}, "1")
    for rows in (x[:1], x):
        got = gemv.linear_widened(rows, w)
        assert got.dtype == torch.float32 and torch.equal(got, F.linear(rows.float(), w))


def test_only_the_sum_gemv_widens_a_narrower_row_and_only_when_asked():
    """The GEMV's choice of products (gemv._takes): a bf16 row against a float32 W only for linear_widened (widen),
    only on a "sum" config, without a bias; same-dtype products as before."""
    x, w32, w16 = torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8), torch.ones(4, 8, dtype=torch.bfloat16)
    total, dot = GemvConfig(4, 2048, 4, 3, "sum"), GemvConfig(16, 256)
    assert gemv._takes(total, x, w32, None, widen=True) and not gemv._takes(total, x, w32, None)
    assert not gemv._takes(dot, x, w32, None, widen=True)
    assert not gemv._takes(total, x, w32, torch.ones(4), widen=True)
    assert gemv._takes(total, x, w16, None) and gemv._takes(dot, x, w16, None)


def test_a_gate_up_projection_with_its_activation_off_the_gemv():
    """A [gate | up] projection asked for its activation computes, where no GEMV takes it as an epilogue,
    exactly F.linear then the activation (the GEMV's epilogue is checked in gemv_cases.py)."""
    from atlas.kernels.fused_ops import act_and_mul_ref
    from atlas.layers.linear import MergedLinear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g)
    gate_up = MergedLinear(40, {0: 16, 1: 16}, bias=True)
    for p in (gate_up.weight, gate_up.bias):
        p.data = torch.randn(p.shape, generator=g)
    with torch.no_grad():
        for act in ("silu", "gelu_pytorch_tanh"):
            assert torch.equal(gate_up(x, act=act),
                               act_and_mul_ref(F.linear(x, gate_up.weight, gate_up.bias), act))


def test_tuning_a_cpu_model_records_nothing():
    from atlas.layers.linear import Linear

    model = torch.nn.Sequential(Linear(8, 4))
    assert linear_weights(model) == {}
    assert gemv.tune_shapes(linear_weights(model), "1") == {}
    assert gemv.choice(4, 8, torch.float32) is None


def test_bench_gemv_shapes_from_a_config_and_from_the_command_line(tmp_path):
    import json

    from atlas.bench.gemv import config_grid, model_shapes, parse_shapes
    from atlas.errors import AtlasError

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "vocab_size": 151936}))
    assert model_shapes(tmp_path / "config.json") == {
        "q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (24576, 4096), "down": (4096, 12288),
        "lm_head": (151936, 4096)}
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(AtlasError, match="--shapes"):
        model_shapes(tmp_path / "config.json")
    assert parse_shapes("6144x4096, 4096X12288") == {"6144x4096": (6144, 4096), "4096x12288": (4096, 12288)}
    for bad in ("6144", "0x4", "axb", ","):
        with pytest.raises(AtlasError):
            parse_shapes(bad)
    grid = config_grid()
    assert len(set(grid)) == len(grid)
    assert all(c.block_n >= 16 for c in grid if c.kind == "dot")  # (tl.dot's smallest tile)
