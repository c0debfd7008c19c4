"""tools/fixed_cost_fit.py recovers the fixed part and the byte rate that made two rows, and its target's fixed part
gives back the target ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fixed_cost_fit as tool  # noqa: E402


def _rows(path: Path, batch: int, ms: float, floor: float) -> str:
    path.write_text(json.dumps({"rows": [{"batch_size": batch, "ms_per_step": ms, "decode_floor_ms": floor}]}))
    return str(path)


def test_the_fit_recovers_the_fixed_part_and_the_rate(tmp_path, capsys):
    fixed, e = 0.5, 0.9
    big = _rows(tmp_path / "big.json", 1, fixed + 3.6 / e, 3.6)
    small = _rows(tmp_path / "small.json", 1, fixed + 1.9 / e, 1.9)
    assert tool.fit(tool.row(big, 1), tool.row(small, 1)) == pytest.approx((fixed, e))
    need = tool.fixed_for(1.75, e, 3.6, 1.9)
    assert tool.ratio_at(need, e, 3.6, 1.9) == pytest.approx(1.75)
    tool.main([big, small, "--kernels", "250", "--target", "1.75"])
    out = capsys.readouterr().out
    assert "F = 0.500 ms (2.00 us a kernel at 250)" in out and f"needs F <= {need:.3f} ms" in out


def test_rows_in_the_wrong_order_or_batch_are_refused(tmp_path):
    big = _rows(tmp_path / "big.json", 1, 4.0, 3.6)
    small = _rows(tmp_path / "small.json", 1, 2.4, 1.9)
    with pytest.raises(ValueError, match="more bytes"):
        tool.fit(tool.row(small, 1), tool.row(big, 1))
    with pytest.raises(SystemExit, match="no row at batch 256"):
        tool.row(big, 256)
