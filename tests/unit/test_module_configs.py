"""Module configs (``XConfig.from_neox_args``) get their config keys by inheriting the schema's key classes (a section
of megatron/neox_arguments/sections/, or a key group a section inherits): each key is declared once, and the module
declares only fields that are not keys (``NOT_NEOX_KEYS``). A misspelt or renamed key raises instead of silently
keeping a module default, and no key has two defaults or two types.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from megatron.config_utils import check_neox_field_names, declared_keys, neox_overrides, not_neox_keys
from megatron.logging.metrics import LoggingConfig
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import KNOWN_KEYS, NeoXArgs, neox_namespace
from megatron.neox_arguments.keys import KEY_SECTION
from megatron.neox_arguments.neox_args import RUNTIME_ATTRS
from megatron.neox_arguments.sections import SECTIONS
from megatron.parallel_config import ParallelConfig
from tests.harness import REPO_ROOT
from tests.unit.test_neox_args import TINY

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "module_configs"
SECTION_FILES = sorted((REPO_ROOT / "megatron" / "neox_arguments" / "sections").glob("*.py"))


def module_configs() -> list[type]:
    """Every class under megatron/ that defines ``from_neox_args``."""
    found = []
    for path in sorted((REPO_ROOT / "megatron").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "def from_neox_args" not in source:
            continue
        tree = ast.parse(source)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(f, ast.FunctionDef) and f.name == "from_neox_args" for f in node.body
            ):
                module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
                found.append(getattr(importlib.import_module(module), node.name))
    return found


def key_classes() -> list[type]:
    """Every dataclass of the schema: the sections and the key groups they inherit."""
    out = []
    for path in SECTION_FILES:
        module = importlib.import_module(".".join(path.relative_to(REPO_ROOT).with_suffix("").parts))
        out += [c for c in vars(module).values() if dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    return out


CONFIGS = module_configs()
SECTION_CLASSES = set(SECTIONS.values())
GROUPS = [c for c in key_classes() if c not in SECTION_CLASSES]


def test_every_module_config_is_found() -> None:
    names = {cls.__name__ for cls in CONFIGS}
    assert len(CONFIGS) >= 17 and {"GPTModelConfig", "CheckpointConfig", "DataConfig", "LoopConfig"} <= names


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_no_module_config_declares_a_key(cls: type) -> None:
    """A module config's own annotations hold no config key: it inherits every key from the schema."""
    assert not declared_keys(cls), f"{cls.__name__} declares config key(s) {declared_keys(cls)}: inherit their group"
    key_bases = [b for b in cls.__mro__[1:] if b in SECTION_CLASSES or b in GROUPS]
    keys = {f.name for f in dataclasses.fields(cls)} & KNOWN_KEYS
    assert keys == {f.name for b in key_bases for f in dataclasses.fields(b)}, "every key field comes from a base"


def test_keys_are_keyword_only() -> None:
    """The schema classes are keyword-only: a key's position in a module config follows its groups' order, so a
    positional argument would silently bind another key."""
    for cls in CONFIGS:
        positional = [f.name for f in dataclasses.fields(cls) if f.name in KNOWN_KEYS and not f.kw_only]
        assert not positional, f"{cls.__name__}: keys that can be passed by position: {positional}"
    with pytest.raises(TypeError, match="positional argument"):
        LoggingConfig(100)  # type: ignore[misc]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_fields_are_schema_keys_or_declared(cls: type) -> None:
    check_neox_field_names(cls)  # raises TypeError naming the field and the closest key
    fields = {f.name for f in dataclasses.fields(cls)}
    declared = not_neox_keys(cls)
    assert set(declared) <= fields, f"{cls.__name__}.NOT_NEOX_KEYS names no field: {set(declared) - fields}"
    assert not set(declared) & KNOWN_KEYS, f"{cls.__name__}.NOT_NEOX_KEYS lists real keys: {set(declared) & KNOWN_KEYS}"


def test_a_restated_key_is_caught() -> None:
    from megatron.neox_arguments.sections.other import SeedKeys

    @dataclasses.dataclass
    class Restates(SeedKeys):
        log_interval: int = 100  # the schema's value, still a second declaration

    @dataclasses.dataclass
    class Fine(SeedKeys):
        extra: int = 3
        NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("extra",)

    assert declared_keys(Restates) == ["log_interval"] and declared_keys(Fine) == []
    with pytest.raises(TypeError, match=r"Restates declares config keys itself: log_interval; inherit"):
        check_neox_field_names(Restates)
    assert neox_overrides(Fine, neox_namespace(seed=7)) == {"seed": 7}


def test_each_key_is_declared_in_exactly_one_class() -> None:
    declared = Counter(name for c in key_classes() for name in inspect.get_annotations(c))
    assert {k for k, n in declared.items() if n > 1} == set()
    assert set(declared) == KNOWN_KEYS


def test_each_key_group_is_inherited_by_exactly_one_section() -> None:
    assert GROUPS, "the sections carve key groups out"
    for group in GROUPS:
        owners = [s.__name__ for s in SECTIONS.values() if group in s.__mro__]
        assert len(owners) == 1, f"{group.__name__} is inherited by the sections {owners}"
        assert group.__name__.endswith("Keys"), group.__name__
    for cls in CONFIGS:  # a module config carries groups and whole sections, never a section's fields restated
        assert not [b for b in cls.__bases__ if b not in GROUPS and b not in SECTION_CLASSES and b is not object]


def test_every_key_stays_in_its_section() -> None:
    """The docs grouping and the GPT-NeoX section of every key are as before the key groups (fixture from then)."""
    assert json.loads((FIXTURES / "key_sections.json").read_text()) == KEY_SECTION


def _build(cls: type, args: Any) -> Any:
    if cls.__name__ == "OptimizerConfig":
        return cls.from_neox_args(args, ParallelConfig.from_neox_args(args))
    if cls.__name__ == "BatchConfig":
        return cls.from_neox_args(args, 0)
    if cls.__name__ == "PlanInputs":
        return cls.from_neox_args(args, 128)
    return cls.from_neox_args(args)


def _cases() -> dict[str, Any]:
    args = NeoXArgs.from_ymls([str(REPO_ROOT / "configs/cpu/tiny.yml"), str(REPO_ROOT / "configs/cpu/local_setup.yml")])
    args.update_value("padded_vocab_size", 128)
    return {"tiny.yml": args, "namespace": neox_namespace(TINY, padded_vocab_size=128)}


def test_module_configs_read_the_same_values_as_before() -> None:
    """Every module config built from a real config (configs/cpu/tiny.yml + local_setup.yml) and from a namespace of
    defaults holds, in each key field it had before the key groups, the value it held then (fixture from then;
    ``TrainingSetup.kv_heads`` was ``num_kv_heads``, renamed: the resolved value is not the key)."""
    expected = json.loads((FIXTURES / "module_config_values.json").read_text())
    by_name = {cls.__name__: cls for cls in CONFIGS}
    for label, args in _cases().items():
        assert len(expected[label]) >= 20
        for name, fields in expected[label].items():
            cfg = _build(by_name[name], args)
            got = {field: repr(getattr(cfg, field)) for field in fields}
            assert got == fields, f"{label}: {name}"


TOY_KEY = """
    toy_key: int = arg(7, "A key added by tests/unit/test_module_configs.py.")
"""


def test_a_key_added_to_a_group_is_read_by_its_module_configs(tmp_path: Path) -> None:
    """Adding a key is one declaration: in a copy of the package, a key added to ``SeedKeys`` is a key of the
    ``other`` section, settable in a config, and read by every module config that inherits the group."""
    tree = tmp_path / "megatron"
    subprocess.run(["cp", "-r", str(REPO_ROOT / "megatron"), str(tree)], check=True)
    other = tree / "neox_arguments" / "sections" / "other.py"
    source = other.read_text(encoding="utf-8")
    anchor = "class SeedKeys:\n"
    start = source.index(anchor)
    doc_end = source.index('"""\n', source.index('"""', start) + 3) + 4
    other.write_text(source[:doc_end] + TOY_KEY + source[doc_end:], encoding="utf-8")
    script = textwrap.dedent(
        """
        from megatron.neox_arguments import NeoXArgs, neox_namespace
        from megatron.neox_arguments.keys import KEY_SECTION
        from megatron.initialize import InitConfig
        from megatron.data.data_utils import DataConfig
        from megatron.model.config import GPTModelConfig
        args = NeoXArgs({**TINY, "toy_key": 9}, env=CPU1)
        args.update_value("padded_vocab_size", 128)
        print(KEY_SECTION["toy_key"], args.toy_key, InitConfig.from_neox_args(args).toy_key,
              GPTModelConfig.from_neox_args(args).toy_key, InitConfig().toy_key,
              DataConfig.from_neox_args(neox_namespace(TINY, toy_key=5)).toy_key)
        """
    )
    prelude = "from tests.unit.test_neox_args import CPU1, TINY\n"
    env = {"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", prelude + script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-6:] == ["other", "9", "9", "9", "7", "5"]


def test_required_model_keys_are_still_required() -> None:
    """The schema's default of a required key is None: building a model config without it still fails."""
    shape = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64}
    GPTModelConfig(**shape, padded_vocab_size=128)
    with pytest.raises(TypeError, match=r"GPTModelConfig: required config key\(s\) not set: padded_vocab_size"):
        GPTModelConfig(**shape)
    with pytest.raises(ValueError, match=r"model config is missing required key\(s\): num_layers"):
        GPTModelConfig.from_neox_args(neox_namespace({**TINY, "num_layers": None}, padded_vocab_size=128))


def _nodes_in_from_neox_args(source: str) -> Iterator[tuple[ast.AST, str]]:
    """Every AST node inside a ``from_neox_args`` body, with the name of its argument-object parameter."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "from_neox_args" and len(node.args.args) > 1:
            args = node.args.args[1].arg
            yield from ((n, args) for n in ast.walk(node))


def _getattr_call_on(n: ast.AST, args: str) -> ast.Call | None:
    """``n`` when it is ``getattr(args, ...)`` / ``hasattr(args, ...)``, else None."""
    if (
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
        and len(n.args) >= 2
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id == args
    ):
        return n
    return None


def keys_read_in_from_neox_args(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``getattr(args, "name", ...)`` / ``args.name`` in ``from_neox_args`` bodies."""
    out = []
    for n, args in _nodes_in_from_neox_args(source):
        call = _getattr_call_on(n, args)
        if call is not None and isinstance(call.args[1], ast.Constant):
            out.append((call.lineno, str(call.args[1].value)))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == args:
            out.append((n.lineno, n.attr))
    return out


def test_from_neox_args_reads_only_schema_keys() -> None:
    # explicit_keys: the keys the user set, an attribute every NeoXArgs carries (the launcher reads it)
    allowed = KNOWN_KEYS | set(RUNTIME_ATTRS) | {n for n in dir(NeoXArgs) if not n.startswith("_")} | {"explicit_keys"}
    wrong = []
    for path in sorted((REPO_ROOT / "megatron").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for line, name in keys_read_in_from_neox_args(source) if "from_neox_args" in source else []:
            if name not in allowed:
                wrong.append(f"{path.relative_to(REPO_ROOT)}:{line}: {name}")
    assert not wrong, "from_neox_args reads names that are not NeoX config keys (always the fallback):\n" + "\n".join(
        wrong
    )


def getattr_fallbacks_in_from_neox_args(source: str) -> list[int]:
    """Lines of ``getattr(args, name, default)`` in ``from_neox_args`` bodies: a fallback that hides a missing key."""
    calls = [call for n, args in _nodes_in_from_neox_args(source) if (call := _getattr_call_on(n, args))]
    return [
        call.lineno
        for call in calls
        if isinstance(call.func, ast.Name) and call.func.id == "getattr" and len(call.args) == 3
    ]


def test_from_neox_args_has_no_getattr_fallback() -> None:
    found = []
    for path in sorted((REPO_ROOT / "megatron").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "from_neox_args" in source:
            found += [f"{path.relative_to(REPO_ROOT)}:{line}" for line in getattr_fallbacks_in_from_neox_args(source)]
    assert not found, (
        "from_neox_args must read keys strictly (args.key), not getattr(args, key, default):\n" + "\n".join(found)
    )


def test_a_missing_key_raises_instead_of_defaulting() -> None:
    with pytest.raises(
        TypeError, match=r"LoggingConfig.from_neox_args: the arguments have no key '\w+' \(pass a NeoXArgs"
    ):
        LoggingConfig.from_neox_args(SimpleNamespace(tensorboard_dir=None))
    assert LoggingConfig.from_neox_args(neox_namespace(log_interval=7)).log_interval == 7
    with pytest.raises(ValueError, match=r"unknown key 'log_intervall' in neox_namespace; did you mean 'log_interval'"):
        neox_namespace(log_intervall=7)
    source = "class C:\n    @classmethod\n    def from_neox_args(cls, a):\n        return getattr(a, 'x', 1), getattr(a, 'y')\n"
    assert getattr_fallbacks_in_from_neox_args(source) == [4]


def test_a_misspelt_key_is_caught() -> None:
    @dataclasses.dataclass
    class Misspelt:
        seq_lenght: int = 2048

    with pytest.raises(TypeError, match=r"Misspelt: fields that are not NeoX config keys: seq_lenght \(closest key: "):
        neox_overrides(Misspelt, neox_namespace(seq_length=64))

    from megatron.neox_arguments.sections.model import SequenceKeys

    @dataclasses.dataclass
    class Declared(SequenceKeys):
        extra: int = 3
        NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("extra",)

    values = SimpleNamespace(seq_length=64, max_position_embeddings=None, extra=9)
    assert neox_overrides(Declared, values) == {"seq_length": 64}  # extra: not read; None: the default
    source = "class C:\n    @classmethod\n    def from_neox_args(cls, a):\n        return getattr(a, 'sequence_len', 1), a.hiden\n"
    assert keys_read_in_from_neox_args(source) == [(4, "sequence_len"), (4, "hiden")]


def test_checkpointed_keys_are_marked_next_to_each_key() -> None:
    """The keys a checkpoint records and a load compares are marked in the schema (``arg(..., checkpointed=True)``),
    not listed by hand: GPT-NeoX's eight model-shape args."""
    from megatron.checkpoint import CHECKPOINT_ARG_KEYS
    from megatron.neox_arguments.keys import FIELDS

    assert set(CHECKPOINT_ARG_KEYS) == {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "max_position_embeddings",
        "make_vocab_size_divisible_by",
        "padded_vocab_size",
        "tokenizer_type",
        "model_parallel_size",
    }
    assert all(FIELDS[k].metadata["checkpointed"] for k in CHECKPOINT_ARG_KEYS)
