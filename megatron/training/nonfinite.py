"""Non-finite steps in any precision: a step whose loss or gradients hold NaN/inf is skipped, not applied.

:func:`install_nonfinite_guard` wraps the engine's optimizer step (``_take_model_step``, used by the sequential
and the pipeline engine alike). Before each optimizer step every rank checks its loss flag and its local
gradients, the flags are all-reduced (MAX), and when any rank saw a non-finite value every rank drops the
gradients, leaves the weights, optimizer state and LR schedule untouched and counts a skipped step (as DeepSpeed
does for an fp16 overflow). The skip is logged with its iteration; ``max_consecutive_nonfinite_steps`` skips in a
row abort the run with a clear message. Under fp16 only the loss is checked: non-finite gradients there are
loss-scale overflows, left to DeepSpeed's dynamic loss scaler.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.errors import UserError

logger = logging.getLogger("megatron.train")

GUARD_ATTR = "nonfinite_guard"


class NonFiniteAbort(UserError):
    """Too many consecutive non-finite steps: the run cannot recover by skipping."""


def _grads(engine: Any) -> Iterator[torch.Tensor]:
    for p in engine.module.parameters():
        if p.grad is not None:
            yield p.grad
    opt = engine.optimizer
    for group in (getattr(opt, "averaged_gradients", None) or {}).values():  # ZeRO-1/2 partitions
        for g in group or []:
            if torch.is_tensor(g):
                yield g
    for g in getattr(opt, "fp32_groups_gradients_flat", None) or []:  # bf16 optimizer
        if torch.is_tensor(g):
            yield g


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One read pass per tensor and one host sync: the max-abs norm is finite iff no element is NaN or ±inf."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    peaks = torch.stack([torch.linalg.vector_norm(t.detach(), float("inf")).float().cpu() for t in tensors])
    return bool(torch.isfinite(peaks).all())


def _drop_gradients(engine: Any) -> None:
    """What DeepSpeed's optimizers do on an fp16 overflow: forget this step's gradients."""
    opt = engine.optimizer
    try:
        opt.zero_grad(set_to_none=True)
    except TypeError:
        opt.zero_grad()
    if isinstance(getattr(opt, "averaged_gradients", None), dict):
        opt.averaged_gradients = {}
    for name in ("clear_hp_grads", "clear_lp_grads"):
        if callable(getattr(opt, name, None)):
            getattr(opt, name)()
    engine.module.zero_grad(set_to_none=True)


class NonFiniteGuard:
    """Decides, on all ranks alike, whether the coming optimizer step is applied."""

    def __init__(self, engine: Any, max_consecutive: int) -> None:
        self.engine, self.max_consecutive = engine, max_consecutive
        self.loss_nonfinite = False
        self.consecutive = 0
        self.skipped_total = 0

    def note_loss(self, loss: float | torch.Tensor) -> None:
        """Record a (micro-batch) loss of the current step."""
        if not math.isfinite(float(loss)):
            self.loss_nonfinite = True

    def _agree(self) -> bool:
        local = self.loss_nonfinite
        # fp16: inf gradients are loss-scale overflows, which DeepSpeed's scaler handles (and learns from)
        fp16 = bool(getattr(self.engine, "fp16_enabled", lambda: False)())
        if not local and not fp16:
            local = not _all_finite(list(_grads(self.engine)))
        flag = torch.tensor([1.0 if local else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0] > 0)

    def take_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``_take_model_step``."""
        skip = self._agree()
        self.loss_nonfinite = False
        if not skip:
            self.consecutive = 0
            return original(*args, **kwargs)
        iteration = int(self.engine.global_steps) + 1
        self.consecutive += 1
        self.skipped_total += 1
        _drop_gradients(self.engine)
        engine = self.engine  # the bookkeeping of DeepSpeed's _take_model_step for an fp16 overflow
        engine.skipped_steps += 1
        engine._step_applied = False
        engine.losses = None
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            logger.warning(
                "iteration %d: non-finite loss or gradient, step skipped (%d in a row)", iteration, self.consecutive
            )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteAbort(
                f"{self.consecutive} consecutive steps with a non-finite loss or gradient (last at iteration "
                f"{iteration}): training diverged or the data is broken; lower the learning rate, check the data, "
                "or resume from an earlier checkpoint (max_consecutive_nonfinite_steps sets the limit)"
            )
        return None


def install_nonfinite_guard(engine: Any, max_consecutive: int) -> NonFiniteGuard:
    """Wrap ``engine._take_model_step`` with a :class:`NonFiniteGuard` (stored as ``engine.nonfinite_guard``)."""
    guard = NonFiniteGuard(engine, max_consecutive)
    original = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        return guard.take_step(original, *args, **kwargs)

    engine._take_model_step = take_model_step
    setattr(engine, GUARD_ATTR, guard)
    return guard


def note_loss(engine: Any, loss: float | torch.Tensor) -> None:
    """Tell the engine's guard (if any) about a micro-batch loss before its ``engine.step()``."""
    guard = getattr(engine, GUARD_ATTR, None)
    if guard is not None:
        guard.note_loss(loss)
