"""tools/structured_fuzz.py keeps working: its language check catches an output outside the constraint, and a few of
its random configurations (seeded) match the plain engine, in a subprocess as it is run by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import tool_module

ROOT = Path(__file__).resolve().parents[1]


def test_the_language_check_catches_outputs_outside_the_constraint():
    tool = tool_module("structured_fuzz")
    checks = {str(c): check for c, check in tool.CONSTRAINTS}
    schema, regex = checks[str({"json": tool.SMALL_SCHEMA})], checks[str({"regex": r"[0-9]{3}-[a-z]{2}"})]
    outs = [[([1], '{"ok": true}', "stop"), ([2], '{"ok": 1}', "stop"), ([3], '{"ok": tr', "length")],
            [([4], "123-ab", "stop"), ([5], "123-abc", "stop")], [([6], "anything", "stop")]]
    bad, checked = tool.out_of_language(outs, [schema, regex, None])
    assert checked == 4  # (a text cut by max_tokens and an unconstrained one are not checked)
    assert bad == ["request 0: '{\"ok\": 1}'", "request 1: '123-abc'"]


def test_a_few_random_configurations_match_the_plain_engine():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "structured_fuzz.py"), "--seed", "2", "--configs", "3"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 4 and lines[-1] == "0 failed", proc.stdout
    assert all(" ok (" in line and "(0 grammar" not in line for line in lines[:3]), proc.stdout
