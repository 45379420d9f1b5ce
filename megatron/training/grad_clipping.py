"""Gradient-norm clipping for a plain fp32 optimizer (no ZeRO, fp16 or bf16 wrapper), correct under TP and PP.

DeepSpeed clips such gradients with ``clip_grad_norm_(mpu=engine.mpu)``. Under the pipeline engine that ``mpu`` is
its grid, whose "model-parallel" rank spans pipe × tensor ranks, so replicated parameters (norms, biases) of every
stage after the first are left out of the norm; DeepSpeed 0.19.8 also drops the norm it computed. Here the norm
counts each TP shard once, each replicated parameter once per stage (on TP rank 0), skips the second copy of tied
weights (``ds_pipe_replicated``), sums over the stage × tensor group, clips every gradient and records the norm.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron import mpu


def _counted(param: torch.nn.Parameter, tp_rank: int) -> bool:
    if param.grad is None or getattr(param, "ds_pipe_replicated", False):
        return False
    return tp_rank == 0 or bool(
        getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    )


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, group: Any | None) -> float:
    """Scale the gradients of ``params`` so their global L2 norm is at most ``max_norm``; return the norm before."""
    tp_rank = mpu.get_model_parallel_rank()
    squares = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None and _counted(p, tp_rank)]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)
    if group is not None and mpu.group_size(group) > 1:
        total = mpu.all_reduce_sum(total.to(mpu.comm_device()), group=group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)
    return norm


def install_fp32_clipping(engine: Any) -> None:
    """Replace the engine's fp32 clipping with :func:`clip_grad_norm` (only where DeepSpeed uses that path)."""
    if hasattr(engine.optimizer, "_global_grad_norm") or engine.gradient_clipping() <= 0:
        return  # a wrapper optimizer clips (and reports the norm) itself, or there is no clipping
    grid = getattr(engine, "grid", None)
    # the grid's "model-parallel" group spans this DP replica's pipe stages × tensor ranks
    group = grid.get_model_parallel_group() if grid is not None else mpu.get_model_parallel_group()

    def clip_fp32_gradients() -> None:
        params = list(engine.module.parameters())
        engine._global_grad_norm = clip_grad_norm(params, engine.gradient_clipping(), group)

    engine.clip_fp32_gradients = clip_fp32_gradients
