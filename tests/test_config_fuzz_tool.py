"""tools/config_fuzz.py keeps working: a few of its random configurations (seeded, so the same ones each run) against
the plain engine, on two families, with aborted requests, in a subprocess as it is run by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_few_random_configurations_match_the_plain_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "config_fuzz.py"), "--seed", "0", "--configs", "4", "--aborts",
         "--families", "qwen3,mistral_window", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 5 and lines[-1] == "0 failed", proc.stdout
    assert all(" ok " in line for line in lines[:4]), proc.stdout
