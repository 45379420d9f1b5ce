"""One owner of "which rank am I": ``megatron.mpu.world_rank()`` / ``local_rank()`` (the process group, else the
launcher's variables read by ``megatron.cluster.worker_env``). Library modules do not read ``RANK``/``LOCAL_RANK``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron import mpu
from megatron.cluster.worker_env import launched_local_rank, launched_rank

REPO = Path(__file__).resolve().parents[2]
# Code that sets up or hands on the launcher's environment, where reading the variables is the point.
ALLOWED = {
    "megatron/cluster/worker_env.py": "the owner: fills and reads the launchers' rank variables",
    "megatron/distributed.py": "process start-up: logs and checks the variables it initialises the group from",
    "megatron/evaluation/runner.py": "sets lm-eval's LOCAL_RANK guard to 0 around a call and restores it",
    "megatron/neox_arguments/neox_args.py": "configure_distributed_args: LOCAL_RANK with the caller's fallback",
}
RANK_VARS = {"RANK", "LOCAL_RANK"}


def test_rank_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert mpu.world_rank() == 0 and mpu.local_rank() == 0  # a plain process
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not mpu.is_distributed()
    assert mpu.world_rank() == 3 and mpu.local_rank() == 1  # launched, group not yet initialised
    assert launched_rank({"RANK": "5"}) == 5 and launched_local_rank({}) == 0
    with pytest.raises(ValueError, match="RANK='x' is not valid: it must be an integer"):
        launched_rank({"RANK": "x"})


def _reads_rank_var(node: ast.AST) -> bool:
    """``os.environ.get("RANK")``, ``os.environ["LOCAL_RANK"]``, ``env.get("RANK", …)`` and the like."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"get", "getenv"}:
        first = node.args[0] if node.args else None
        return isinstance(first, ast.Constant) and first.value in RANK_VARS
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return isinstance(node.slice, ast.Constant) and node.slice.value in RANK_VARS
    return False


def test_no_rank_reads_from_the_environment_in_library_modules() -> None:
    found = []
    for path in sorted(REPO.glob("megatron/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        tree = ast.parse(path.read_text(), rel)
        found += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if _reads_rank_var(n)]
    assert not found, f"RANK/LOCAL_RANK read from the environment (use mpu.world_rank()/local_rank()): {found}"
