"""A DeepSpeed engine is typed, not ``Any``: every parameter named ``engine`` or ``model_engine`` of a function under
``megatron/`` is annotated, and not with ``Any`` (megatron/engine_protocol.py's ``Engine`` / ``PipelineEngine`` say
what of DeepSpeed's engine the code uses, and tests/unit/test_deepspeed_adapter.py checks them against DeepSpeed).
The scan reads the source with :mod:`ast` and names ``file:line`` of each parameter typed ``Any`` or not at all."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from tests.harness import REPO_ROOT
from tests.source_ast import python_files

ENGINE_PARAMETERS = ("engine", "model_engine")


def _untyped(annotation: ast.expr | None) -> bool:
    """No annotation, or one that names ``Any`` (``Any``, ``"Any"``, ``typing.Any``, ``Any | None`` …)."""
    if annotation is None:
        return True
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        text = annotation.value  # a string annotation
    return re.search(r"\bAny\b", text) is not None


def untyped_engines(source: str, filename: str) -> list[str]:
    """``filename:line: function(name: annotation)`` for each engine parameter typed ``Any`` or not at all."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue  # (a lambda's parameters cannot be annotated)
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg in ENGINE_PARAMETERS and _untyped(arg.annotation):
                shown = ast.unparse(arg.annotation) if arg.annotation is not None else "no annotation"
                out.append(f"{filename}:{arg.lineno}: {node.name}({arg.arg}: {shown})")
    return out


def test_no_engine_parameter_is_typed_any() -> None:
    found = []
    for path in python_files(REPO_ROOT / "megatron"):
        found += untyped_engines(path.read_text(encoding="utf-8"), path.relative_to(REPO_ROOT).as_posix())
    assert not found, "type the engine with megatron/engine_protocol.py's Engine (or PipelineEngine):\n" + "\n".join(
        found
    )


def test_the_scan_finds_each_form(tmp_path: Path) -> None:
    source = textwrap.dedent(
        """\
        import typing
        from typing import Any
        from megatron.engine_protocol import Engine, PipelineEngine

        def a(engine: Any) -> None: ...
        def b(x: int, *, model_engine: "Any") -> None: ...
        async def c(engine: typing.Any | None) -> None: ...
        class S:
            def d(self, engine) -> None: ...
        def fine(engine: Engine, model_engine: PipelineEngine, other: Any, engines: Any) -> None: ...
        go = lambda engine: engine
        """
    )
    assert untyped_engines(source, "m.py") == [
        "m.py:5: a(engine: Any)",
        "m.py:6: b(model_engine: 'Any')",
        "m.py:7: c(engine: typing.Any | None)",
        "m.py:9: d(engine: no annotation)",
    ]
