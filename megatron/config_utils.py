"""Reading a module's small typed config from GPT-NeoX's flat argument names."""

from __future__ import annotations

import dataclasses
from typing import Any


def neox_overrides(cls: type, args: Any) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` that ``args`` sets under the same (GPT-NeoX) names.

    ``None`` or a missing attribute counts as unset, so ``cls(**neox_overrides(cls, args))`` keeps the dataclass's
    own defaults for those fields.
    """
    return {f.name: value for f in dataclasses.fields(cls) if (value := getattr(args, f.name, None)) is not None}
