"""neox-forge: a GPT-NeoX-compatible training framework (the ``megatron`` package keeps GPT-NeoX's name)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``from megatron import NeoXArgs`` as in GPT-NeoX, without importing the config package for every submodule."""
    if name == "NeoXArgs":
        from megatron.neox_arguments import NeoXArgs

        return NeoXArgs
    raise AttributeError(f"module 'megatron' has no attribute {name!r}")
