"""Every entry point imports ``megatron/setup_check.py`` before any package outside the standard library
(docs/architecture.md), so a Python without the packages gets one line naming them instead of a traceback."""

from __future__ import annotations

import ast
import sys

from tests.harness import REPO_ROOT

NOT_ENTRY_POINTS = {"setup.py"}  # the package's build script


def entry_points() -> list[str]:
    """The top-level scripts and every ``tools/`` file that runs as a program (``if __name__ == "__main__"``)."""
    out = [p.name for p in sorted(REPO_ROOT.glob("*.py")) if p.name not in NOT_ENTRY_POINTS]
    for path in sorted((REPO_ROOT / "tools").rglob("*.py")):
        if '__name__ == "__main__"' in path.read_text(encoding="utf-8"):
            out.append(path.relative_to(REPO_ROOT).as_posix())
    return out


def first_third_party_import(source: str) -> str | None:
    """The first module-level import of a module outside the standard library, as written."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name != "__future__" and name.split(".")[0] not in sys.stdlib_module_names:
                return name
    return None


def test_entry_points_import_the_setup_check_first() -> None:
    points = entry_points()
    assert {"train.py", "deepy.py", "generate.py", "eval.py", "tools/ckpts/convert_neox_to_hf.py"} <= set(points)
    late = {p: first_third_party_import((REPO_ROOT / p).read_text()) for p in points}
    late = {p: first for p, first in late.items() if first != "megatron.setup_check"}
    assert not late, f"import megatron.setup_check first (first import outside the standard library): {late}"
    assert first_third_party_import("import os\nimport torch\nimport megatron.setup_check\n") == "torch"
