"""Gradient-norm clipping for a plain fp32 optimizer (no ZeRO, fp16 or bf16 wrapper), correct under TP and PP.

DeepSpeed clips such gradients with ``clip_grad_norm_(mpu=engine.mpu)``. Under the pipeline engine that ``mpu`` is
its grid, whose "model-parallel" rank spans pipe × tensor ranks, so replicated parameters (norms, biases) of every
stage after the first are left out of the norm; DeepSpeed 0.19.8 also drops the norm it computed. Here the norm
counts each TP shard once, each replicated parameter once per stage (on TP rank 0), skips the second copy of tied
weights (``ds_pipe_replicated``), sums over the stage × tensor group and scales every gradient, all on the device
(no host read: the coefficient is applied as a tensor, as ``torch.nn.utils.clip_grad_norm_`` does). The training
step calls :class:`Fp32Clipping` before its optimizer step; wrapped optimizers (ZeRO, fp16, bf16) clip inside
DeepSpeed's step and report their norm through ``engine.get_global_grad_norm()``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.training.deepspeed_adapter import engine_clips_fp32, leave_fp32_clipping_to_the_step


def _counted(param: torch.nn.Parameter, tp_rank: int) -> bool:
    if param.grad is None or getattr(param, "ds_pipe_replicated", False):
        return False
    return tp_rank == 0 or bool(
        getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    )


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, group: Any | None) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global L2 norm is at most ``max_norm``; return the norm before
    (a 0-dim float32 device tensor)."""
    tp_rank = mpu.get_model_parallel_rank()
    squares = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None and _counted(p, tp_rank)]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)
    if group is not None and mpu.group_size(group) > 1:
        total = mpu.all_reduce_sum(total.to(mpu.comm_device()), group=group)
    norm = total.sqrt()
    # float64, as the Python float this coefficient was computed in before; multiplying by exactly 1.0 leaves a
    # gradient unchanged, so gradients under the limit are untouched
    coef = max_norm / (norm.double() + 1e-6)
    coef = torch.where(coef < 1.0, coef, torch.ones_like(coef))
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device, torch.float32))
    return norm


class Fp32Clipping:
    """The step's clipping of a plain fp32 optimizer's gradients (DeepSpeed's own is turned off on this engine)."""

    def __init__(self, engine: Engine, max_norm: float, group: Any | None) -> None:
        self.engine, self.max_norm, self.group = engine, max_norm, group

    def __call__(self) -> torch.Tensor:
        """Clip; returns the norm before clipping (device tensor)."""
        return clip_grad_norm(list(self.engine.module.parameters()), self.max_norm, self.group)


def fp32_clipping_for(engine: Engine) -> Fp32Clipping | None:
    """The step's clipping where DeepSpeed would clip a plain fp32 optimizer (None elsewhere: a wrapper optimizer
    clips and reports the norm itself, or there is no clipping)."""
    if not engine_clips_fp32(engine):
        return None
    grid = getattr(engine, "grid", None)
    # the grid's "model-parallel" group spans this DP replica's pipe stages × tensor ranks
    group = grid.get_model_parallel_group() if grid is not None else mpu.get_model_parallel_group()
    clipping = Fp32Clipping(engine, float(engine.gradient_clipping()), group)
    leave_fp32_clipping_to_the_step(engine)
    return clipping
