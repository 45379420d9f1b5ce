"""Where ``torch_compile`` can run: the layouts it is refused in, each with the reason (see
:mod:`megatron.training.torch_compile`)."""

from __future__ import annotations

from typing import Any

# (key, is this value refused?, what to do instead)
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("pipe_parallel_size", lambda v: v >= 1, "DeepSpeed's pipeline engine runs its own layer schedule; use 0"),
    ("model_parallel_size", lambda v: v > 1, "tensor-parallel collectives are not compiled; use 1"),
    ("zero_stage", lambda v: v == 3, "ZeRO-3 gathers parameters in module hooks a compiled graph skips; use 0-2"),
    ("moe_num_experts", lambda v: v > 1, "dropless MoE routing has data-dependent shapes; use dense layers"),
)


def torch_compile_problems(values: dict[str, Any]) -> list[str]:
    """Readable problems of ``torch_compile: true`` with the other resolved keys (empty when it can run)."""
    if not values.get("torch_compile"):
        return []
    out = []
    for key, refused, instead in _REFUSED:
        value = values.get(key)
        if value is not None and refused(value):
            out.append(f"torch_compile: true is not supported yet with {key}={value!r}: {instead}")
    return out
