"""The one owner of "precision name → torch dtype" (the ``precision`` key, ``inference_precision``, the HF tools).

Lives in the config layer, the lowest one that knows the key, so the config object, the model config, the run
plan, generation and the checkpoint tools all map through :func:`dtype_of_precision`. torch is imported inside the
function: the config layer does not import torch at module level (the launcher starts fast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# spellings GPT-NeoX configs and tools use, → the canonical torch dtype name
PRECISION_NAMES: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def dtype_of_precision(precision: str) -> torch.dtype:
    """The torch dtype of a precision name (``fp32``/``float32``, ``fp16``/``float16``/``half``, ``bf16``/``bfloat16``,
    any case); ``ValueError`` naming the valid names otherwise."""
    import torch

    name = PRECISION_NAMES.get(str(precision).lower())
    if name is None:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISION_NAMES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype
