"""What the tests that read the project's source with :mod:`ast` share (they never import or run what they read):
the dotted name of an attribute chain, and the project's Python files below a folder."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

# Not our source: skipped anywhere (plus hidden folders such as .venv), and run outputs at the top level only
# (``megatron/data`` is source; ``data/`` and ``runs/`` are the quick start's outputs).
SKIPPED_DIRS = {"venv", "node_modules", "__pycache__"}
SKIPPED_TOP_DIRS = {"build", "dist", "data", "runs"}


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def python_files(root: Path) -> Iterator[Path]:
    """Every ``*.py`` under ``root`` outside hidden, virtual-env and cache folders and the top-level run outputs."""
    for folder, dirs, files in os.walk(root):
        top = Path(folder) == root
        dirs[:] = sorted(
            d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or (top and d in SKIPPED_TOP_DIRS))
        )
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))
