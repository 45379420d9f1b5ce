"""neox-forge: a GPT-NeoX-compatible training framework (the ``megatron`` package keeps GPT-NeoX's name)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``from megatron import NeoXArgs`` / ``initialize_megatron`` as in GPT-NeoX, without importing the config
    package (or torch) for every submodule."""
    if name == "NeoXArgs":
        from megatron.neox_arguments import NeoXArgs

        return NeoXArgs
    if name == "initialize_megatron":
        from megatron.initialize import initialize_megatron

        return initialize_megatron
    raise AttributeError(f"module 'megatron' has no attribute {name!r}")
