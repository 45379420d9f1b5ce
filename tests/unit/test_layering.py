"""Layering: only ``megatron/mpu`` and ``megatron/distributed.py`` talk to ``torch.distributed``.

Every other module goes through mpu's collectives (``mpu.world_rank()``, ``mpu.barrier()``,
``mpu.all_reduce_sum(...)`` …), so process groups, reduction ops and the plain-process fallbacks live in one place.
The check walks the source tree with ``ast`` (strings and comments that merely name ``torch.distributed`` are fine;
imports under ``if TYPE_CHECKING:`` are fine) and names ``file:line`` of each violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from tests.source_ast import dotted_name, python_files

# Modules that wrap torch.distributed for everything else (DeepSpeed's ``deepspeed.comm`` is the same layer).
FORBIDDEN_MODULES = ("torch.distributed", "deepspeed.comm")

# Paths (relative to the repository root; a trailing "/" means a folder) allowed to use them, with the reason.
ALLOWED: dict[str, str] = {
    "megatron/mpu/": "the collective API itself: process groups, mappings, collectives",
    "megatron/distributed.py": "process start-up and tear-down (init_process_group through DeepSpeed, destroy)",
    "tests/": "tests build process groups themselves and check mpu's answers against torch.distributed's own",
    "benchmarks/bench_train.py": "the A/B baseline is a plain-PyTorch DDP loop, written as a user without neox-forge",
}


def _forbidden(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) bodies."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and dotted_name(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def violations_in(source: str, filename: str) -> list[str]:
    """``filename:line: what`` for each use of a forbidden module in ``source``."""
    tree = ast.parse(source, filename=filename)
    exempt = _type_checking_nodes(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            if _forbidden(node.module) or any(_forbidden(n) for n in names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute) and dotted_name(node) in FORBIDDEN_MODULES:
            found.append((node.lineno, f"{dotted_name(node)} attribute"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = dotted_name(node.func)
            arg = node.args[0].value
            importer = callee in ("importlib.import_module", "import_module", "__import__")
            if importer and isinstance(arg, str) and _forbidden(arg):
                found.append((node.lineno, f"{callee}({arg!r})"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def _allowed(relative: str) -> bool:
    return any(relative == p or (p.endswith("/") and relative.startswith(p)) for p in ALLOWED)


def find_violations(root: Path) -> list[str]:
    """Violations in every Python file under ``root`` that :data:`ALLOWED` does not cover."""
    out: list[str] = []
    for path in python_files(root):
        relative = path.relative_to(root).as_posix()
        if _allowed(relative):
            continue
        out += violations_in(path.read_text(encoding="utf-8"), relative)
    return out


def test_no_torch_distributed_outside_mpu() -> None:
    found = find_violations(REPO_ROOT)
    assert not found, (
        "torch.distributed (or deepspeed.comm) used outside megatron/mpu and megatron/distributed.py; use the "
        "collectives of megatron.mpu (world_rank, barrier, all_reduce_sum, all_gather_objects ...) instead:\n"
        + "\n".join(found)
    )


def test_allowed_paths_exist() -> None:
    missing = [p for p in ALLOWED if not (REPO_ROOT / p.rstrip("/")).exists()]
    assert not missing, f"stale entries in ALLOWED: {missing}"


PLANTED = '''\
"""Mentions torch.distributed in a docstring: fine."""
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import distributed
from torch.distributed import ReduceOp
import importlib

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LOGGER = "torch.distributed"  # a string: fine


def rank() -> int:
    return torch.distributed.get_rank()


def comm():
    return importlib.import_module("deepspeed.comm")
'''


@pytest.mark.parametrize(
    "where", ["megatron/training/planted.py", "megatron/data/planted.py", "tools/ckpts/planted.py", "planted.py"]
)
def test_planted_violation_is_reported_with_file_and_line(tmp_path: Path, where: str) -> None:
    target = tmp_path / where
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(PLANTED)
    (tmp_path / "megatron" / "mpu").mkdir(parents=True, exist_ok=True)
    (tmp_path / "megatron" / "mpu" / "fine.py").write_text(PLANTED)  # allowed: the collective API
    (tmp_path / "megatron" / "distributed.py").write_text(PLANTED)  # allowed: process start-up
    for skipped in (".venv/lib/site.py", "data/x/planted.py", "megatron/__pycache__/planted.py"):  # not our source
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_text(PLANTED)
    assert find_violations(tmp_path) == [
        f"{where}:5: import torch.distributed",
        f"{where}:6: from torch import distributed",
        f"{where}:7: from torch.distributed import ReduceOp",
        f"{where}:17: torch.distributed attribute",
        f"{where}:21: importlib.import_module('deepspeed.comm')",
    ]


def test_clean_file_passes(tmp_path: Path) -> None:
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "ok.py").write_text(
        "from megatron import mpu\n\n\ndef rank() -> int:\n    return mpu.world_rank()\n"
    )
    assert find_violations(tmp_path) == []
