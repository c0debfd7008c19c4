"""The two folder indexes a newcomer reads stay whole: every script in tools/ has a row in tools/README.md, and
every folder of benchmarks/ one in benchmarks/README.md (a script or result folder added without its row is
invisible to the next reader)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _named(readme: Path) -> set[str]:
    """The names a README's tables give in their first column: `name` or `name/`."""
    names = set()
    for line in readme.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+?)/?`\s*\|", line)
        if m:
            names.add(m.group(1))
    return names


def test_every_tool_has_a_row():
    listed = _named(ROOT / "tools" / "README.md")
    scripts = {p.name for p in (ROOT / "tools").iterdir() if p.is_file() and p.suffix in (".py", ".sh")}
    assert scripts, "tools/ holds no scripts"
    assert not scripts - listed, f"tools/README.md has no row for {sorted(scripts - listed)}"
    gone = listed - {p.name for p in (ROOT / "tools").iterdir()}
    assert not gone, f"tools/README.md lists scripts that are gone: {sorted(gone)}"


def test_every_benchmark_folder_has_a_row():
    listed = _named(ROOT / "benchmarks" / "README.md")
    folders = {p.name for p in (ROOT / "benchmarks").iterdir() if p.is_dir()}
    assert folders, "benchmarks/ holds no folders"
    assert not folders - listed, f"benchmarks/README.md has no row for {sorted(folders - listed)}"
    assert not listed - folders, f"benchmarks/README.md lists folders that are gone: {sorted(listed - folders)}"
