"""docs/gpt-neox-differences.md names, in each row's last column, the tests that pin our side: they must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_a_row_names_exists() -> None:
    defined = {
        name for path in (ROOT / "tests").rglob("*.py") for name in re.findall(r"def (test_\w+)", path.read_text())
    }
    missing, named = [], 0
    for line in (ROOT / "docs/gpt-neox-differences.md").read_text().splitlines():
        cells = line.strip().strip("|").split(" | ")
        if not line.startswith("| ") or len(cells) != 5 or cells[0] == "behaviour":
            continue
        for ref in re.findall(r"`((?:tests/|test_)[^`]*)`", cells[-1]):
            path, _, name = ref.partition("::") if ref.startswith("tests/") else ("", "", ref)
            named += 1
            if (path and not (ROOT / path).is_file()) or (name and name.split("[")[0] not in defined):
                missing.append(ref)
    assert named > 50 and not missing, missing
