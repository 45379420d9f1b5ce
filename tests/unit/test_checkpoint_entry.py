"""Checkpoint code lives in one package, ``megatron/checkpoint/``, with one entry module, its ``__init__.py``.

Code outside the package (``megatron/``, ``tools/``, ``benchmarks/``, scripts) imports from ``megatron.checkpoint``,
never from one of its submodules; the exceptions are listed with their reason. Tests are not scanned: they test the
submodules themselves. ``megatron/checkpointing.py`` (GPT-NeoX's import path) only re-exports GPT-NeoX's
``save_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import REPO_ROOT
from tests.source_ast import python_files

PACKAGE = "megatron.checkpoint"

# (path prefix, submodule) imported from outside the package on purpose, with the reason.
ALLOWED: dict[tuple[str, str], str] = {
    ("tools/ckpts/", "megatron.checkpoint.cli"): "the checkpoint tools' shared command-line glue (logging, "
    "--trust-checkpoint, progress bars, error -> exit code), not part of the checkpoint API",
    ("benchmarks/planner_reference.py", "megatron.checkpoint.layout"): "the planner benchmark's baseline puts "
    "DeepSpeed's partition_balanced back in place of the stage split's own and turns its memo off",
    ("benchmarks/bench_planner.py", "megatron.checkpoint.layout"): "the planner benchmark empties the stage split's "
    "memo between timed runs (a cold plan each time)",
}


def _submodules(root: Path) -> set[str]:
    folder = root / "megatron" / "checkpoint"
    return {f"{PACKAGE}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"} | {
        f"{PACKAGE}.{p.name}" for p in folder.iterdir() if (p / "__init__.py").is_file()
    }


def _exported(root: Path) -> set[str]:
    """The entry's ``__all__`` (a name it exports wins over a submodule of that name, e.g. ``tokenizer_identity``)."""
    tree = ast.parse((root / "megatron" / "checkpoint" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def submodule_imports(
    source: str, filename: str, submodules: set[str], exported: frozenset[str] = frozenset()
) -> list[tuple[int, str]]:
    """(line, submodule) for each import of a submodule of the package in ``source`` (``import a.b.c``,
    ``from a.b.c import x``, ``from a.b import c`` unless ``c`` is in ``exported``), at any level of the file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            entry = exported if node.module == PACKAGE else frozenset()
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name not in entry]
        for name in names:
            hit = next((m for m in submodules if name == m or name.startswith(m + ".")), None)
            if hit is not None:
                found.append((node.lineno, hit))
    return sorted(set(found))


def violations(root: Path) -> list[str]:
    """``path:line: imports submodule`` for each import of a submodule from outside the package, not in ALLOWED."""
    submodules, exported = _submodules(root), frozenset(_exported(root))
    out: list[str] = []
    for path in python_files(root):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(("megatron/checkpoint/", "tests/")):
            continue
        for line, module in submodule_imports(path.read_text(encoding="utf-8"), relative, submodules, exported):
            if not any(relative.startswith(prefix) and module == m for prefix, m in ALLOWED):
                out.append(f"{relative}:{line}: imports {module}")
    return out


def test_code_outside_the_package_imports_only_its_entry() -> None:
    found = violations(REPO_ROOT)
    assert not found, (
        "import checkpoint code from megatron.checkpoint (export the name from megatron/checkpoint/__init__.py), "
        "not from its submodules:\n" + "\n".join(found)
    )


def test_allowed_exceptions_are_used() -> None:
    """An exception that no longer happens is removed from the list, so the list stays true."""
    submodules, exported = _submodules(REPO_ROOT), frozenset(_exported(REPO_ROOT))
    used = set()
    for path in python_files(REPO_ROOT):
        relative = path.relative_to(REPO_ROOT).as_posix()
        for _, module in submodule_imports(path.read_text(encoding="utf-8"), relative, submodules, exported):
            used |= {(p, m) for p, m in ALLOWED if relative.startswith(p) and module == m}
    assert set(ALLOWED) <= used, f"stale, remove from ALLOWED: {set(ALLOWED) - used}"


def test_entry_exports_what_it_imports() -> None:
    import megatron.checkpoint as entry

    missing = [name for name in entry.__all__ if not hasattr(entry, name)]
    assert not missing, f"megatron.checkpoint.__all__ names what it does not define: {missing}"


def test_planted_submodule_imports_are_reported(tmp_path: Path) -> None:
    folder = tmp_path / "megatron" / "checkpoint"
    (folder / "sub").mkdir(parents=True)
    for name in ("reader.py", "cli.py", "naming.py", "sub/__init__.py"):
        (folder / name).write_text("")
    (folder / "__init__.py").write_text('from megatron.checkpoint.naming import naming\n__all__ = ["naming"]\n')
    (folder / "save.py").write_text("from megatron.checkpoint.reader import x\n")  # inside the package: fine
    (tmp_path / "megatron" / "user.py").write_text(
        "from megatron.checkpoint import read_checkpoint, reader\n"
        "import megatron.checkpoint.sub\n"
        "def f():\n"
        "    from megatron.checkpoint.reader import load_torch\n"
        "from megatron import checkpoint\n"
        "from megatron.checkpointing import save_checkpoint\n"
        "from megatron.checkpoint import naming\n"  # the entry's name, not the submodule
        "from megatron.checkpoint.naming import naming\n"
    )
    (tmp_path / "tools" / "ckpts").mkdir(parents=True)
    (tmp_path / "tools" / "ckpts" / "tool.py").write_text("from megatron.checkpoint import cli\n")  # listed
    (tmp_path / "tools" / "other.py").write_text("from megatron.checkpoint import cli\n")  # listed for tools/ckpts only
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from megatron.checkpoint.reader import x\n")  # tests: fine
    assert violations(tmp_path) == [
        "megatron/user.py:1: imports megatron.checkpoint.reader",
        "megatron/user.py:2: imports megatron.checkpoint.sub",
        "megatron/user.py:4: imports megatron.checkpoint.reader",
        "megatron/user.py:8: imports megatron.checkpoint.naming",
        "tools/other.py:1: imports megatron.checkpoint.cli",
    ]


def test_gpt_neox_import_path_only_re_exports() -> None:
    """``megatron/checkpointing.py`` holds a docstring, imports from ``megatron.training.gpt_neox_api`` and
    ``__all__``: no code of its own, and the names are the very functions of the GPT-NeoX API module."""
    path = REPO_ROOT / "megatron" / "checkpointing.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    kinds = [type(node).__name__ for node in body]
    assert all(
        isinstance(node, ast.ImportFrom) and node.module == "megatron.training.gpt_neox_api" for node in body[:-1]
    )
    assert kinds[-1] == "Assign" and ast.unparse(body[-1]).startswith("__all__ ="), kinds

    import megatron.checkpointing as shim
    import megatron.training.gpt_neox_api as api

    assert sorted(shim.__all__) == ["load_checkpoint", "save_checkpoint"]
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(api, name), name
