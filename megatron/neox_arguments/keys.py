"""The key table of the schema: every GPT-NeoX key's section, dataclass field and resolved type annotation.

Built once from :mod:`megatron.neox_arguments.sections`; read by ``NeoXArgs`` and by the deepy command line
(``deepy_cli``), which both sit above it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from megatron.neox_arguments.sections import SECTIONS

# key -> section name / dataclass field / resolved annotation / default, for every GPT-NeoX key.
KEY_SECTION: dict[str, str] = {}
FIELDS: dict[str, dataclasses.Field] = {}
HINTS: dict[str, Any] = {}
for _section, _cls in SECTIONS.items():
    _hints = typing.get_type_hints(_cls)
    for _f in dataclasses.fields(_cls):
        if _f.name in KEY_SECTION:
            raise RuntimeError(f"key {_f.name} declared in sections {KEY_SECTION[_f.name]} and {_section}")
        KEY_SECTION[_f.name], FIELDS[_f.name], HINTS[_f.name] = _section, _f, _hints[_f.name]
KNOWN_KEYS: set[str] = set(KEY_SECTION)
# The model-shape keys every checkpoint records and a load compares with the config (``arg(..., checkpointed=True)``).
CHECKPOINTED_KEYS: tuple[str, ...] = tuple(k for k, f in FIELDS.items() if f.metadata.get("checkpointed"))
