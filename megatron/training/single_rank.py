"""One data-parallel rank needs no gradient all-reduce.

DeepSpeed's ZeRO-0 engine reduces the gradients after every backward even when the data-parallel group has a
single rank: it flattens all gradients into a bucket (a copy), all-reduces it over gloo/NCCL with itself, scales
it and copies it back — three passes over the gradients for nothing. With one DP rank, fp32 parameters and a plain
torch optimizer, :func:`skip_single_rank_allreduce` switches that reduction off (the gradients are already the
result).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("megatron.train")


def skip_single_rank_allreduce(engine: Any, dp_world_size: int) -> bool:
    """Turn off the engine's backward all-reduce when it can only copy; returns whether it did."""
    plain_optimizer = isinstance(getattr(engine, "optimizer", None), torch.optim.Optimizer)
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else -1
    pipe = bool(getattr(engine, "pipeline_parallelism", False))
    moe = bool(getattr(engine, "has_moe_layers", False))
    if dp_world_size != 1 or stage != 0 or pipe or moe or not plain_optimizer:
        return False
    if not getattr(engine, "enable_backward_allreduce", False):
        return False
    engine.enable_backward_allreduce = False
    logger.debug("one data-parallel rank: DeepSpeed's backward gradient all-reduce skipped")
    return True
