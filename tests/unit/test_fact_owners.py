"""One owner per fact: the ZeRO stage, the precision → dtype mapping and the pipeline + ZeRO >= 2 rule are each
decided in one place, which the others receive from (an AST scan of megatron/, so a second reader fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.parallel_config import ParallelConfig
from tests.harness import REPO_ROOT
from tests.unit.test_neox_args import CPU1, TINY

MEGATRON = REPO_ROOT / "megatron"
CONFIG_LAYER = MEGATRON / "neox_arguments"  # derives and validates the keys
STAGE_OWNER = MEGATRON / "parallel_config.py"
ARGS_TYPES = {"NeoXArgs", "NeoXValues", "SimpleNamespace"}
ARGS_NAMES = {"args", "neox_args"}
STAGE_KEY_CLASSES = {"ZeroKeys", "OptimizerArgs"}  # the key group declaring zero_stage, and its section
KEY_READERS = {"neox_values", "neox_overrides"}  # megatron/config_utils.py: fill a module config's keys from the args


def _args_params(tree: ast.AST) -> set[str]:
    """Names of parameters that hold the configuration (annotated NeoXArgs/NeoXValues, or named args/neox_args)."""
    names = set(ARGS_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in [*node.args.args, *node.args.kwonlyargs]:
                if a.annotation is not None and ast.unparse(a.annotation).strip("'\"") in ARGS_TYPES:
                    names.add(a.arg)
    return names


def zero_stage_reads(source: str) -> list[int]:
    """Lines where ``source`` reads the ZeRO stage from the configuration: ``args.zero_stage``,
    ``getattr(args, "zero_stage")``, a module config inheriting the key (``ZeroKeys``) that fills its keys from the
    args (``neox_values`` / ``neox_overrides``; one that receives the stage as a value does not read it), or
    ``...zero_optimization...["stage"]`` / ``.get("stage")``."""
    tree = ast.parse(source)
    params = _args_params(tree)
    return sorted(n.lineno for n in ast.walk(tree) if _reads_stage(n, params))


def _reads_stage(n: ast.AST, params: set[str]) -> bool:
    if isinstance(n, ast.Attribute) and n.attr == "zero_stage" and isinstance(n.value, ast.Name):
        return n.value.id in params
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"):
        return len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value == "zero_stage"
    if isinstance(n, ast.ClassDef) and any(ast.unparse(b) in STAGE_KEY_CLASSES for b in n.bases):
        return any(isinstance(c, ast.Name) and c.id in KEY_READERS for c in ast.walk(n))
    if isinstance(n, ast.Subscript) and "zero_optimization" in ast.unparse(n.value):
        return isinstance(n.slice, ast.Constant) and n.slice.value == "stage"
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get":
        return "zero_optimization" in ast.unparse(n.func.value) and bool(n.args) and ast.unparse(n.args[0]) == "'stage'"
    return False


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted(MEGATRON.rglob("*.py"))]


def test_only_the_parallel_config_reads_the_zero_stage() -> None:
    """The config layer derives ``zero_stage`` from ``zero_optimization.stage`` once (derive.py); of the modules
    that use it, only ``ParallelConfig`` reads it, and the optimizer config receives it from there."""
    found = []
    for path, source in _sources():
        if path == STAGE_OWNER or CONFIG_LAYER in path.parents:
            continue
        found += [f"{path.relative_to(REPO_ROOT)}:{line}" for line in zero_stage_reads(source)]
    assert not found, "the ZeRO stage is read from the configuration outside ParallelConfig:\n" + "\n".join(found)
    assert zero_stage_reads(STAGE_OWNER.read_text(encoding="utf-8")), "the owner reads it (the scan sees reads)"


def test_the_scan_sees_each_kind_of_read() -> None:
    source = (
        "class C(ZeroKeys):\n    f = neox_values\n"
        "def f(args):\n    return args.zero_stage\n"
        "def g(cfg: NeoXValues):\n    return cfg.zero_stage, getattr(cfg, 'zero_stage')\n"
        "def h(v):\n    return v.zero_optimization['stage'], (v.zero_optimization or {}).get('stage')\n"
        "def ok(plan, layout):\n    return layout.zero_stage, plan.zero_stage\n"
        "class Receives(ZeroKeys):\n    x: int = 0\n"
    )
    assert zero_stage_reads(source) == [1, 4, 6, 6, 8, 8]


def test_precision_is_mapped_to_a_dtype_only_by_its_owner() -> None:
    """``precision`` is derived once (``neox_arguments/derive.py``, from the fp16/bf16 sections) and mapped to a
    torch dtype once (``neox_arguments/precision.py``); the model config does not derive it again."""
    model_config = (MEGATRON / "model" / "config.py").read_text(encoding="utf-8")
    assert "args.fp16" not in model_config and "args.bf16" not in model_config
    assert "dtype_of_precision(args.precision)" in model_config


def test_pipeline_zero_rule_lives_once_in_the_rule_table() -> None:
    """The pipeline + ZeRO >= 2 rule is one entry of ``validate.py``'s table; ``ParallelConfig`` relies on it."""
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=2 cannot be combined with pipe_parallel_size=1"):
        NeoXArgs({**TINY, "pipe_parallel_size": 1, "zero_optimization": {"stage": 2}}, env=CPU1)
    ok = NeoXArgs({**TINY, "pipe_parallel_size": 0, "zero_optimization": {"stage": 3}}, env=CPU1)
    assert ParallelConfig.from_neox_args(ok).zero_stage == 3
    sites = [
        path.relative_to(REPO_ROOT).as_posix()
        for path, source in _sources()
        if "pipeline engine supports ZeRO stage" in source
    ]
    assert sites == ["megatron/neox_arguments/validate.py"], sites


def test_offline_model_configs_get_the_config_layers_rules_and_precision(tmp_path: Path) -> None:
    """Checkpoint tools build a ``GPTModelConfig`` from YAML files without a launch: the config layer still derives
    the precision and checks the model's shape (the rules ``GPTModelConfig`` no longer repeats)."""
    from megatron.checkpoint import config_io

    shape = "num_layers: 2\nnum_attention_heads: 4\nmax_position_embeddings: 16\nseq_length: 16\n"
    good = tmp_path / "good.yml"
    good.write_text(shape + "hidden_size: 32\nfp16: {enabled: true}\n")
    assert str(config_io.model_config(config_io.load_neox_args([good]), 64).params_dtype) == "torch.float16"
    bad = tmp_path / "bad.yml"
    bad.write_text(shape + "hidden_size: 30\nhidden_dropout: 1.0\n")
    with pytest.raises(ConfigError) as e:
        config_io.model_config(config_io.load_neox_args([bad]), 64)
    assert "hidden_size=30 is not divisible by num_attention_heads=4" in e.value.problems
    assert any(p.startswith("hidden_dropout=1.0 must be in [0, 1)") for p in e.value.problems)
