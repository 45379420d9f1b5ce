"""Field helper for the config sections: every key carries its default, type (the annotation) and a docstring."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


def arg(default: Any, doc: str, *, derived: bool = False, checkpointed: bool = False) -> Any:
    """Declare one config key.

    ``doc`` is the key's documentation (rendered into docs/neox_arguments.md). ``derived`` marks keys that
    ``derive()`` computes (users may still set them; the derived value must then agree or is recomputed).
    ``checkpointed`` marks the model-shape keys every checkpoint records and a load compares with the config
    (GPT-NeoX's checkpoint ``args``; ``megatron.checkpoint.CHECKPOINT_ARG_KEYS``).
    """
    metadata = {"doc": " ".join(doc.split()), "derived": derived, "checkpointed": checkpointed}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_doc(f: dataclasses.Field) -> str:
    """The docstring recorded for a dataclass field (empty when none)."""
    return str(f.metadata.get("doc", ""))
