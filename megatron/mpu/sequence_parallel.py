"""Gradient sync for replicated parameters that see only a sequence shard under sequence parallelism.

With ``sequence_parallel`` each TP rank runs the norms (and dropout/residual regions) on its own slice of
the sequence, so the gradients of their replicated parameters are partial per rank. GPT-NeoX all-reduces them
over the TP group; here a tensor hook does it before the gradient is accumulated into ``.grad``, so DeepSpeed
(any ZeRO stage) sees the complete gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.mpu.initialize import get_model_parallel_world_size
from megatron.mpu.mappings import _all_reduce


def _sum_over_tp(grad: torch.Tensor) -> torch.Tensor:
    return _all_reduce(grad)


def mark_norms_for_sequence_parallel_grad_sync(
    module: nn.Module, exclude_suffixes: tuple[str, ...] = ("q_norm", "k_norm")
) -> int:
    """Sum over TP the gradients of the parameters of every submodule whose class name contains "norm".

    Submodules whose qualified name ends with one of ``exclude_suffixes`` are skipped (query/key norms run on
    the gathered sequence). Call once after building the model when ``sequence_parallel`` is on (no effect at
    TP size 1). TP-sharded parameters (``tensor_model_parallel``) are never summed. Parameters already marked (``sequence_parallel_grad_sync`` or ``sequence_parallel`` set) are
    left alone, so nothing is summed twice. Returns the number of parameters newly marked.
    """
    if get_model_parallel_world_size() == 1:
        return 0
    marked = 0
    for name, sub in module.named_modules():
        if "norm" not in type(sub).__name__.lower() or name.endswith(exclude_suffixes):
            continue
        for param in sub.parameters(recurse=False):
            if not param.requires_grad or getattr(param, "sequence_parallel_grad_sync", False):
                continue
            if getattr(param, "sequence_parallel", False) or getattr(param, "tensor_model_parallel", False):
                continue  # already synced, or a TP shard whose gradient is this rank's own
            param.register_hook(_sum_over_tp)
            param.sequence_parallel_grad_sync = True
            param.sequence_parallel = True
            marked += 1
    return marked
