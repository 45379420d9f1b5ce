"""Below the entry points, functions take their module's config or plain values, not the whole argument object.

A function under ``megatron/`` or ``tools/`` with a parameter annotated ``NeoXArgs``/``NeoXValues`` (or named
``args``/``neox_args`` and annotated ``Any`` or not at all) must be listed in ``ENTRY_LEVEL`` (the glue right
under the entry points, and GPT-NeoX's API, which takes the argument object by design). docs/architecture.md lists
the entry-level functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The config layer owns the argument object, and config_utils is how module configs read it.
OWNERS = ("megatron/neox_arguments/", "megatron/config_utils.py")

ENTRY_LEVEL: dict[str, str] = {
    "megatron/training/pretraining.py:pretrain": "train.py's work: builds every module config once",
    "megatron/generation/text_generation.py:run_generation": "generate.py's work: builds the InferenceConfig once",
    "megatron/evaluation/standalone.py:evaluate_checkpoint": "eval.py's work: builds the eval/inference configs once",
    "megatron/launcher/launch.py:write_run_dir": "deepy.py: writes the resolved argument object to the run folder",
    "megatron/tokenizer/__init__.py:build_neox_args_tokenizer": "GPT-NeoX API: build_tokenizer(neox_args)",
    "megatron/initialize.py:initialize_megatron": "GPT-NeoX API; the work is start_processes(InitConfig)",
    "megatron/fused_kernels/__init__.py:load": "GPT-NeoX API: fused_kernels.load(neox_args)",
    "megatron/text_generation_utils.py:generate_samples_from_prompt": "GPT-NeoX API module",
    "megatron/training/gpt_neox_api.py:pretrain": "GPT-NeoX API: megatron.training.pretrain(neox_args)",
    "megatron/training/gpt_neox_api.py:setup_model_and_optimizer": "GPT-NeoX API",
    "megatron/training/gpt_neox_api.py:save_checkpoint": "GPT-NeoX API",
    "megatron/training/gpt_neox_api.py:load_checkpoint": "GPT-NeoX API",
}


def _annotated_whole_args(arg: ast.arg) -> bool:
    ann = ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else None
    if ann is not None and ("NeoXArgs" in ann or "NeoXValues" in ann):
        return True
    return arg.arg in ("args", "neox_args") and ann in (None, "Any")


def whole_args_functions(root: Path) -> dict[str, int]:
    """``path:Class.function`` → line of every function that takes the whole argument object (``from_neox_args``,
    the module configs' reader, excepted)."""
    found: dict[str, int] = {}
    files = sorted([*root.glob("megatron/**/*.py"), *root.glob("tools/**/*.py")])
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel.startswith(OWNERS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), rel)

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                    if child.name != "from_neox_args" and any(_annotated_whole_args(p) for p in params):
                        found[f"{rel}:{prefix}{child.name}"] = child.lineno
                    visit(child, f"{prefix}{child.name}.")

        visit(tree, "")
    return found


def test_no_whole_args_below_the_entry_points() -> None:
    found = whole_args_functions(REPO)
    unlisted = sorted(f"{name} (line {line})" for name, line in found.items() if name not in ENTRY_LEVEL)
    assert not unlisted, (
        "functions below the entry points take the whole argument object (pass the module's config or the values "
        "it needs; a new entry-level function goes into ENTRY_LEVEL and docs/architecture.md):\n" + "\n".join(unlisted)
    )
    stale = sorted(name for name in ENTRY_LEVEL if name not in found)
    assert not stale, f"listed functions that no longer take the argument object (remove them): {stale}"


def test_the_scan_sees_annotations_and_names(tmp_path: Path) -> None:
    pkg = tmp_path / "megatron"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from typing import Any\n"
        "def a(args: 'NeoXArgs') -> None: ...\n"
        "def b(neox_args: Any) -> None: ...\n"
        "def c(cfg: Config, *args: Any) -> None: ...\n"
        "class K:\n    def d(self, x: NeoXValues | None) -> None: ...\n"
        "    @classmethod\n    def from_neox_args(cls, args: NeoXValues) -> None: ...\n"
    )
    assert set(whole_args_functions(tmp_path)) == {"megatron/m.py:a", "megatron/m.py:b", "megatron/m.py:K.d"}


def test_entry_level_list_is_in_the_docs() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [name for name in ENTRY_LEVEL if f"`{name}`" not in doc]
    assert not missing, f"docs/architecture.md does not list the entry-level functions {missing}"


# Writes into the argument object after validation: GPT-NeoX's API does them by design (its callers read the
# values back). pretrain derives its values into its own copy (``NeoXArgs.derived``).
WRITERS: dict[str, str] = {
    "megatron/tokenizer/__init__.py": "GPT-NeoX API build_tokenizer(neox_args) sets tokenizer and padded_vocab_size",
    "megatron/training/gpt_neox_api.py": "GPT-NeoX API setup_model_and_optimizer sets iteration",
}


def test_nothing_else_writes_into_the_arguments() -> None:
    found = []
    for path in sorted([*REPO.glob("megatron/**/*.py"), *REPO.glob("tools/**/*.py"), *REPO.glob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(OWNERS) or rel in WRITERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update_value":
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"the argument object is changed after validation (derive the value instead): {found}"
