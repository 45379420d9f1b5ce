"""Module configs (``XConfig.from_neox_args``) read NeoX config keys under their schema names and declare nothing
about a key but its (schema) type: defaults come from the schema (``from_schema()``), so a misspelt or renamed key
raises instead of silently keeping a module default, and no key has two defaults or two types.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import ClassVar

import pytest

from megatron.config_utils import (
    check_neox_field_names,
    declaration_problems,
    from_schema,
    neox_overrides,
    not_neox_keys,
    schema_defaults,
)
from megatron.logging.metrics import LoggingConfig
from megatron.neox_arguments import KNOWN_KEYS, default_values, neox_namespace
from megatron.neox_arguments.neox_args import RUNTIME_ATTRS, NeoXArgs
from tests.harness import REPO_ROOT

# Module configs whose fields are not a mirror of the schema, with the reason.
NOT_MIRRORS: dict[str, str] = {
    "TrainingSetup": "the planner's derived view with its own short names (tp, dp, gas ...); every field is required",
}


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


CONFIGS = module_configs()
MIRRORS = [cls for cls in CONFIGS if cls.__name__ not in NOT_MIRRORS]


def test_every_module_config_is_found() -> None:
    names = {cls.__name__ for cls in CONFIGS}
    assert len(CONFIGS) >= 17 and {"GPTModelConfig", "CheckpointConfig", "DataConfig", "LoopConfig"} <= names
    assert set(NOT_MIRRORS) <= names


@pytest.mark.parametrize("cls", MIRRORS, ids=lambda c: c.__name__)
def test_fields_are_schema_keys_or_declared(cls: type) -> None:
    check_neox_field_names(cls)  # raises TypeError naming the field and the closest key
    fields = {f.name for f in dataclasses.fields(cls)}
    declared = not_neox_keys(cls)
    assert set(declared) <= fields, f"{cls.__name__}.NOT_NEOX_KEYS names no field: {set(declared) - fields}"
    assert not set(declared) & KNOWN_KEYS, f"{cls.__name__}.NOT_NEOX_KEYS lists real keys: {set(declared) & KNOWN_KEYS}"


@pytest.mark.parametrize("cls", MIRRORS, ids=lambda c: c.__name__)
def test_each_key_is_declared_once(cls: type) -> None:
    """A module-config field that is a key takes the schema's default (``from_schema()``) or none, and its type."""
    assert not declaration_problems(cls), "\n".join(declaration_problems(cls))


def test_a_second_declaration_is_caught() -> None:
    @dataclasses.dataclass
    class OwnDefault:
        log_interval: int = 100  # the schema's value, still a second declaration

    @dataclasses.dataclass
    @schema_defaults
    class OtherType:
        log_interval: float = from_schema()
        seq_length: int | None = None

    @dataclasses.dataclass
    class NotAKey:
        log_intervall: int

    @dataclasses.dataclass(kw_only=True)
    @schema_defaults
    class Fine:
        log_interval: int = from_schema()
        seq_length: int  # required, typed as the schema
        padded_vocab_size: int  # set while running (schema: int | None): a module may require it

    assert declaration_problems(OwnDefault) == ["OwnDefault.log_interval: declares its own default; use from_schema()"]
    assert declaration_problems(OtherType) == [
        "OtherType.log_interval: type <class 'float'> is not the schema's <class 'int'>",
        "OtherType.seq_length: declares its own default; use from_schema()",
        "OtherType.seq_length: type int | None is not the schema's <class 'int'>",
    ]
    assert declaration_problems(NotAKey) == ["NotAKey.log_intervall: not a config key (nor in NOT_NEOX_KEYS)"]
    assert declaration_problems(Fine) == []
    assert Fine(seq_length=8, padded_vocab_size=64).log_interval == default_values()["log_interval"]
    with pytest.raises(TypeError, match=r"seq_length = from_schema\(\): the key has no default"):

        @schema_defaults
        class Required:
            seq_length: int = from_schema()


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
    with pytest.raises(TypeError, match=r"LoggingConfig.from_neox_args: the arguments have no key 'log_interval'"):
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

    @dataclasses.dataclass
    class Declared:
        seq_length: int = 2048
        extra: int = 3
        NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("extra",)

    assert neox_overrides(Declared, SimpleNamespace(seq_length=64, extra=9)) == {"seq_length": 64}  # extra: not read
    source = "class C:\n    @classmethod\n    def from_neox_args(cls, a):\n        return getattr(a, 'sequence_len', 1), a.hiden\n"
    assert keys_read_in_from_neox_args(source) == [(4, "sequence_len"), (4, "hiden")]
