"""GPT-NeoX's ``megatron.utils`` helpers that scripts call."""

from __future__ import annotations

from megatron import mpu


def is_mp_rank_0() -> bool:
    """True on the first rank of its model-parallel group (and without model parallelism)."""
    return mpu.get_model_parallel_rank() == 0 if mpu.model_parallel_is_initialized() else True
