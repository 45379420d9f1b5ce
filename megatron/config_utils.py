"""Reading a module's small typed config from GPT-NeoX's flat argument names."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from megatron.neox_arguments.neox_args import NeoXArgs

# What ``XConfig.from_neox_args`` reads: the validated ``NeoXArgs``, or a namespace holding every key
# (``megatron.neox_arguments.neox_namespace``: offline readers of a saved config, tests).
NeoXValues: TypeAlias = "NeoXArgs | SimpleNamespace"


@functools.cache
def _schema_keys() -> frozenset[str]:
    # Imported on first use: the config layer's validate.py imports module configs (post_training), whose module
    # imports this one, so a top-level import would be a cycle.
    from megatron.neox_arguments import KNOWN_KEYS

    return frozenset(KNOWN_KEYS)


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

    ``cls(**neox_overrides(cls, args))`` then keeps the dataclass's own default for those fields, which equals the
    schema's (tests/unit/test_module_configs.py lists the few that are derived or required instead).
    """
    return {name: value for name, value in neox_values(cls, args).items() if value is not None}
