"""The size limits of ../DESIGN.md that docs/architecture.md states: entry points of about 80 lines, one concept per
file of at most 500 lines (library and tools)."""

from __future__ import annotations

from pathlib import Path

from tests.harness import REPO_ROOT

ENTRY_POINTS = ("deepy.py", "train.py", "eval.py", "generate.py")
ENTRY_POINT_LINES = 80
FILE_LINES = 500


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_entry_points_stay_thin() -> None:
    sizes = {name: _lines(REPO_ROOT / name) for name in ENTRY_POINTS}
    assert all(n <= ENTRY_POINT_LINES for n in sizes.values()), sizes


def test_no_library_or_tool_file_is_over_500_lines() -> None:
    files = [*(REPO_ROOT / "megatron").rglob("*.py"), *(REPO_ROOT / "tools").rglob("*.py")]
    assert len(files) > 100  # the walk found the code
    over = {str(p.relative_to(REPO_ROOT)): n for p in files if (n := _lines(p)) > FILE_LINES}
    assert not over, f"split these files (one concept per file, at most {FILE_LINES} lines): {over}"
