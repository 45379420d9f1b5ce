"""ZeRO++'s hpZ and MiCS on the installed DeepSpeed (real engines, gloo ranks): what the planner says neox-forge can
run (tests/unit/test_planner_zero3_groups.py asserts on the plain data returned here)."""

from __future__ import annotations

from typing import Any

from tests.distributed import fns_deepspeed_adapter as fns


def losses(zero: dict[str, Any]) -> list[float]:
    """Three steps of the adapter checks' tiny model under ``zero``: the losses, or the refusal's message."""
    engine = fns._engine(zero_optimization=zero)
    out = []
    for _ in range(3):
        loss = fns._loss(engine)
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def refusal(zero: dict[str, Any]) -> str:
    """The error DeepSpeed raises when it builds an engine with ``zero``; empty when it builds one."""
    try:
        fns._engine(zero_optimization=zero)
    except Exception as e:  # the message is the result
        return f"{type(e).__name__}: {e}"
    return ""
