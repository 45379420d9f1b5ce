"""One owner of the ``global_stepN`` checkpoint tag (``megatron.checkpoint.tags``): format, parse, list."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from megatron.checkpoint.tags import checkpoint_dirs, checkpoint_tag, tag_iteration

REPO = Path(__file__).resolve().parents[2]
OWNER = REPO / "megatron" / "checkpoint" / "tags.py"


def test_format_and_parse_round_trip() -> None:
    assert checkpoint_tag(0) == "global_step0" and checkpoint_tag(1200) == "global_step1200"
    assert tag_iteration("global_step1200") == 1200 and tag_iteration(Path("/x/global_step7")) == 7
    for other in ("global_step", "global_step1.bak", "latest", ".partial-global_step3", "global_stepx"):
        assert tag_iteration(other) is None, other
    with pytest.raises(ValueError, match="iteration is >= 0"):
        checkpoint_tag(-1)


def test_checkpoint_dirs_sorted_by_iteration(tmp_path: Path) -> None:
    for name in ("global_step1000", "global_step5", "global_step100", "global_step9.tmp", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "global_step7").write_text("a file, not a checkpoint")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["global_step5", "global_step100", "global_step1000"]
    assert checkpoint_dirs(tmp_path / "missing") == []


def _tag_handling(node: ast.AST) -> bool:
    """An f-string that formats ``global_step{…}``, or a glob/startswith/regex/slice on the tag prefix."""
    if isinstance(node, ast.JoinedStr):
        parts = node.values
        return any(
            isinstance(a, ast.Constant) and str(a.value).endswith("global_step") and isinstance(b, ast.FormattedValue)
            for a, b in itertools.pairwise(parts)
        )
    methods = {"glob", "rglob", "startswith", "removeprefix", "compile", "match", "fullmatch"}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
        return any(isinstance(a, ast.Constant) and "global_step" in str(a.value) for a in node.args)
    return False


def test_no_other_tag_formatting_or_parsing() -> None:
    copies = []
    for path in sorted([*REPO.glob("megatron/**/*.py"), *REPO.glob("tools/**/*.py"), *REPO.glob("*.py")]):
        if path == OWNER:
            continue
        tree = ast.parse(path.read_text(), str(path))
        copies += [f"{path.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree) if _tag_handling(n)]
    assert not copies, f"global_stepN formatted or parsed outside megatron/checkpoint/tags.py: {copies}"
