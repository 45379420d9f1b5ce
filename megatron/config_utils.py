"""Reading a module's small typed config from GPT-NeoX's flat argument names."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from megatron.neox_arguments.neox_args import NeoXArgs

# What ``XConfig.from_neox_args`` reads: the validated ``NeoXArgs``, or a namespace holding every key
# (``megatron.neox_arguments.neox_namespace``: offline readers of a saved config, tests).
NeoXValues: TypeAlias = "NeoXArgs | SimpleNamespace"


@functools.cache
def _schema_keys() -> frozenset[str]:
    # Imported where used (here and in schema_defaults, when a module config class is defined): this module stays
    # importable on its own, whichever of it and the config package is imported first.
    from megatron.neox_arguments import KNOWN_KEYS

    return frozenset(KNOWN_KEYS)


_FROM_SCHEMA = "from_schema"


def from_schema() -> Any:
    """The default of a module-config field that is a config key: the schema's default for that key.

    Write ``log_interval: int = from_schema()`` in a dataclass decorated with :func:`schema_defaults` (under
    ``@dataclass``). The key's type, default, range and doc are declared once, in its schema section
    (megatron/neox_arguments/sections/); the module states only the type, which tests/unit/test_module_configs.py
    checks equals the schema's. A key without a schema default (required, or derived) is declared without a default.
    """
    return dataclasses.field(default=None, metadata={_FROM_SCHEMA: True})


def schema_defaults(cls: type) -> type:
    """Class decorator (below ``@dataclass``): give each ``from_schema()`` field its key's default from the schema.

    Raises ``TypeError`` for a field that is not a config key, or whose key has no default (``None`` while its type
    excludes ``None``: a required or derived key, which the module must declare without a default).
    """
    from megatron.neox_arguments.keys import FIELDS, HINTS  # see _schema_keys: imported on first use

    for name, value in list(vars(cls).items()):
        if not (isinstance(value, dataclasses.Field) and value.metadata.get(_FROM_SCHEMA)):
            continue
        f = FIELDS.get(name)
        if f is None:
            raise TypeError(f"{cls.__name__}.{name} = from_schema(): {name} is not a NeoX config key")
        hint = HINTS[name]
        nullable = hint is Any or type(None) in typing.get_args(hint)
        if f.default is None and not nullable:
            raise TypeError(
                f"{cls.__name__}.{name} = from_schema(): the key has no default (required or derived); declare the "
                "field without one"
            )
        metadata = {_FROM_SCHEMA: True}
        if f.default_factory is not dataclasses.MISSING:
            field = dataclasses.field(default_factory=f.default_factory, metadata=metadata)
        else:
            field = dataclasses.field(default=f.default, metadata=metadata)
        setattr(cls, name, field)
    return cls


def is_from_schema(f: dataclasses.Field) -> bool:
    """Whether the dataclass field ``f`` takes its default from the schema (``from_schema()``)."""
    return bool(f.metadata.get(_FROM_SCHEMA))


def _without_none(hint: Any) -> Any:
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    if not members or len(members) == len(typing.get_args(hint)):
        return hint
    return members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007 - built from a tuple


def declaration_problems(cls: type) -> list[str]:
    """Where the module config ``cls`` declares a config key a second time, one line each (empty: none).

    Every field that is a config key (not in ``NOT_NEOX_KEYS``) must take its default from the schema
    (``from_schema()``) or have none, and be annotated with the schema's type. A field without a default may drop
    ``None`` from a key whose schema default is ``None`` (set while running, such as ``padded_vocab_size``): the
    module requires it, and ``from_neox_args`` refuses it unset.
    """
    from megatron.neox_arguments.keys import FIELDS, HINTS

    hints = typing.get_type_hints(cls)
    problems = []
    for f in dataclasses.fields(cls):
        if f.name in not_neox_keys(cls):
            continue
        if f.name not in FIELDS:
            problems.append(f"{cls.__name__}.{f.name}: not a config key (nor in NOT_NEOX_KEYS)")
            continue
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if has_default and not is_from_schema(f):
            problems.append(f"{cls.__name__}.{f.name}: declares its own default; use from_schema()")
        elif has_default:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            schema = FIELDS[f.name]
            expected = schema.default_factory() if schema.default_factory is not dataclasses.MISSING else schema.default
            if default != expected:
                problems.append(f"{cls.__name__}.{f.name}: default {default!r} is not the schema's {expected!r}")
        want = HINTS[f.name]
        narrowed = not has_default and FIELDS[f.name].default is None and hints[f.name] == _without_none(want)
        if hints[f.name] != want and not narrowed:
            problems.append(f"{cls.__name__}.{f.name}: type {hints[f.name]} is not the schema's {want}")
    return problems


def not_neox_keys(cls: type) -> tuple[str, ...]:
    """Fields of the module config ``cls`` that are not NeoX config keys (its ``NOT_NEOX_KEYS`` class variable)."""
    return tuple(getattr(cls, "NOT_NEOX_KEYS", ()))


def check_neox_field_names(cls: type) -> None:
    """Raise ``TypeError`` unless every field of the dataclass ``cls`` is a NeoX config key or in ``NOT_NEOX_KEYS``.

    A module config reads its fields under the schema's names, so a field name that is not a key (a typo, a key
    renamed in the schema) would otherwise always keep the module's own default without a word.
    """
    keys, not_keys = _schema_keys(), not_neox_keys(cls)
    wrong = [f.name for f in dataclasses.fields(cls) if f.name not in keys and f.name not in not_keys]
    if wrong:
        hints = [
            f"{name} (closest key: {', '.join(difflib.get_close_matches(name, keys, 2)) or 'none'})" for name in wrong
        ]
        raise TypeError(f"{cls.__name__}: fields that are not NeoX config keys: {'; '.join(hints)}")


def neox_values(cls: type, args: NeoXValues) -> dict[str, Any]:
    """Every field of the dataclass ``cls`` read strictly from ``args`` under the same (GPT-NeoX) name.

    ``args`` is a ``NeoXArgs`` or any object that holds every key (``neox_namespace``): a key it lacks raises
    ``TypeError`` naming the key, it never falls back to a default. Every field must be a NeoX config key (see
    :func:`check_neox_field_names`) except ``NOT_NEOX_KEYS``, which are not read.
    """
    check_neox_field_names(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in not_neox_keys(cls):
            continue
        try:
            out[f.name] = getattr(args, f.name)
        except AttributeError:
            raise TypeError(
                f"{cls.__name__}.from_neox_args: the arguments have no key {f.name!r} "
                "(pass a NeoXArgs, or neox_namespace(...) which holds every key)"
            ) from None
    return out


def neox_overrides(cls: type, args: NeoXValues) -> dict[str, Any]:
    """:func:`neox_values` without the keys whose value is ``None`` (unset).

    ``cls(**neox_overrides(cls, args))`` then keeps the field's default for those keys, which is the schema's
    (``from_schema()``; tests/unit/test_module_configs.py checks every module config).
    """
    return {name: value for name, value in neox_values(cls, args).items() if value is not None}
