"""Reading a module's small typed config from GPT-NeoX's flat argument names.

A module config gets its config keys by inheriting the schema's key classes (a section of
``megatron/neox_arguments/sections/``, or a key group a section inherits, such as ``SeedKeys``): each key's type,
default and doc are declared once, there. The class itself declares only fields that are not config keys, and lists
them in ``NOT_NEOX_KEYS``; tests/unit/test_module_configs.py checks no module config declares a key itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from megatron.neox_arguments.neox_args import NeoXArgs

# What ``XConfig.from_neox_args`` reads: the validated ``NeoXArgs``, or a namespace holding every key
# (``megatron.neox_arguments.neox_namespace``: offline readers of a saved config, tests).
NeoXValues: TypeAlias = "NeoXArgs | SimpleNamespace"


@functools.cache
def _schema_keys() -> frozenset[str]:
    # Imported where used: this module stays importable on its own, whichever of it and the config package is
    # imported first.
    from megatron.neox_arguments import KNOWN_KEYS

    return frozenset(KNOWN_KEYS)


def not_neox_keys(cls: type) -> tuple[str, ...]:
    """Fields of the module config ``cls`` that are not NeoX config keys (its ``NOT_NEOX_KEYS`` class variable)."""
    return tuple(getattr(cls, "NOT_NEOX_KEYS", ()))


def declared_keys(cls: type) -> list[str]:
    """The config keys the class ``cls`` annotates itself (not inherited): a module config must declare none."""
    return [name for name in inspect.get_annotations(cls) if name in _schema_keys()]


def check_neox_field_names(cls: type) -> None:
    """Raise ``TypeError`` unless every field of the dataclass ``cls`` is a NeoX config key or in ``NOT_NEOX_KEYS``.

    A field the class declares that is neither (a misspelt key, a key renamed in the schema) would otherwise never
    be read; a key the class declares itself restates the schema.
    """
    keys, not_keys = _schema_keys(), not_neox_keys(cls)
    wrong = [f.name for f in dataclasses.fields(cls) if f.name not in keys and f.name not in not_keys]
    if wrong:
        hints = [
            f"{name} (closest key: {', '.join(difflib.get_close_matches(name, keys, 2)) or 'none'})" for name in wrong
        ]
        raise TypeError(f"{cls.__name__}: fields that are not NeoX config keys: {'; '.join(hints)}")
    restated = declared_keys(cls)
    if restated:
        raise TypeError(
            f"{cls.__name__} declares config keys itself: {', '.join(restated)}; inherit the schema class that "
            "declares them (megatron/neox_arguments/sections/)"
        )


def neox_values(cls: type, args: NeoXValues) -> dict[str, Any]:
    """Every key field of the dataclass ``cls`` read strictly from ``args`` under the same (GPT-NeoX) name.

    ``args`` is a ``NeoXArgs`` or any object that holds every key (``neox_namespace``): a key it lacks raises
    ``TypeError`` naming the key, it never falls back to a default. ``NOT_NEOX_KEYS`` are not read.
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

    ``cls(**neox_overrides(cls, args))`` then keeps the field's default for those keys: the schema's, which the
    class inherits with the key.
    """
    return {name: value for name, value in neox_values(cls, args).items() if value is not None}


def require_keys(cfg: Any, keys: tuple[str, ...]) -> None:
    """Raise ``TypeError`` naming the required keys that are unset (``None``) on the module config ``cfg``.

    A key the schema requires or derives has the default ``None``; a module that needs it calls this from its
    ``__post_init__``, so building the config without it fails as a missing argument did.
    """
    unset = [k for k in keys if getattr(cfg, k) is None]
    if unset:
        raise TypeError(f"{type(cfg).__name__}: required config key(s) not set: {', '.join(unset)}")
