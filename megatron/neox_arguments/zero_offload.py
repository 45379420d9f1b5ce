"""Where ZeRO-Offload puts the optimizer and the parameters, read from a ``zero_optimization`` block as DeepSpeed
reads it: the ``offload_optimizer`` / ``offload_param`` blocks' ``device`` (``none``, DeepSpeed's default, offloads
nothing), or the deprecated flags ``cpu_offload`` / ``cpu_offload_param`` that DeepSpeed maps to ``device: cpu``."""

from __future__ import annotations

from typing import Any

OFFLOAD_DEVICES = ("cpu", "nvme")
DEPRECATED_FLAGS = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}


def offload_device(zero: dict[str, Any] | None, block: str) -> str:
    """``cpu``, ``nvme`` or ``none`` for ``block`` (``offload_optimizer`` or ``offload_param``) of ``zero``."""
    zero = zero if isinstance(zero, dict) else {}
    section = zero.get(block)
    if isinstance(section, dict) and section.get("device") is not None:
        return str(section["device"]).lower()
    return "cpu" if zero.get(DEPRECATED_FLAGS[block]) is True else "none"


def offloaded_blocks(zero: dict[str, Any] | None) -> tuple[str, ...]:
    """The blocks that move tensors off the GPU."""
    return tuple(b for b in DEPRECATED_FLAGS if offload_device(zero, b) in OFFLOAD_DEVICES)


def deprecated_flag_problems(zero: dict[str, Any] | None) -> list[str]:
    """A deprecated flag set true beside its replacing block: DeepSpeed refuses the pair (an assertion at start)."""
    zero = zero if isinstance(zero, dict) else {}
    return [
        f"zero_optimization sets both {flag}: true (deprecated) and {block}; DeepSpeed refuses the pair: keep {block}"
        for block, flag in DEPRECATED_FLAGS.items()
        if zero.get(flag) is True and zero.get(block) is not None
    ]


def without_redundant_flags(zero: dict[str, Any]) -> dict[str, Any]:
    """``zero`` without a deprecated flag set false beside its replacing block (GPT-NeoX's Pythia configs write
    ``cpu_offload: false``; DeepSpeed refuses it beside ``offload_optimizer`` although it says nothing)."""
    drop = {flag for block, flag in DEPRECATED_FLAGS.items() if zero.get(flag) is False and zero.get(block) is not None}
    return {k: v for k, v in zero.items() if k not in drop}
