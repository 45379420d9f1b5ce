"""Every key with its default as plain values: ``default_values()`` and ``neox_namespace()``, for readers that need
keys without a validated ``NeoXArgs`` (a saved config from an older version, a module config built from a few keys)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from megatron.neox_arguments.derive import LaunchEnv, derive
from megatron.neox_arguments.keys import KNOWN_KEYS
from megatron.neox_arguments.loader import unknown_key_message
from megatron.neox_arguments.sections import SECTIONS

RUNTIME_ATTRS = ("tokenizer", "tensorboard_writer", "adlr_autoresume_object")


def default_values() -> dict[str, Any]:
    """Every key with its GPT-NeoX default."""
    out = {}
    for cls in SECTIONS.values():
        out.update(dataclasses.asdict(cls()))
    return out


def neox_namespace(values: dict[str, Any] | None = None, /, **more: Any) -> SimpleNamespace:
    """Every key with its GPT-NeoX default, then ``values`` and ``more`` over it, then the derived keys
    (``derive()``, as ``NeoXArgs`` computes them), as plain attributes.

    Not validated, and not typed (unlike ``NeoXArgs``): for offline readers of a saved config (a checkpoint's
    ``resolved_config.json`` from an older version may lack newer keys) and for module configs built from a few keys.
    A derived key the given values cannot determine (no batch size given) keeps its default. A name that is not a
    key raises ``ValueError`` naming the closest keys.
    """
    given = {**(values or {}), **more}
    for key in given:
        if key not in KNOWN_KEYS and key not in RUNTIME_ATTRS:
            raise ValueError(unknown_key_message(key, "neox_namespace", KNOWN_KEYS))
    resolved = {**default_values(), **given}
    updates, _ = derive(resolved, set(given), LaunchEnv())  # problems are the validating NeoXArgs' business
    resolved.update({k: v for k, v in updates.items() if k not in given or given[k] is None})
    return SimpleNamespace(**resolved)
