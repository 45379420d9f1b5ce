"""Non-finite steps in any precision: a step whose loss or gradients hold NaN/inf is skipped, not applied.

:func:`install_nonfinite_guard` wraps the engine's optimizer step (``_take_model_step``, used by the sequential
and the pipeline engine alike). Before each optimizer step every rank checks its loss flag and its local
gradients, the flags are all-reduced (MAX), and when any rank saw a non-finite value every rank drops the
gradients, leaves the weights, optimizer state and LR schedule untouched and counts a skipped step (as DeepSpeed
does for an fp16 overflow). The skip is logged with its iteration; ``max_consecutive_nonfinite_steps`` skips in a
row abort the run with a clear message. Under fp16 only the loss is checked: non-finite gradients there are
loss-scale overflows, left to DeepSpeed's dynamic loss scaler. With ``loss_spike_skip_window`` set, a step whose
loss spikes (:mod:`megatron.training.loss_spike`) is skipped the same way and counts toward the same limit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from megatron import mpu
from megatron.errors import UserError
from megatron.training.loss_spike import LossSpikeDetector

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

    def __init__(self, engine: Any, max_consecutive: int, spike: LossSpikeDetector | None = None) -> None:
        self.engine, self.max_consecutive, self.spike = engine, max_consecutive, spike
        self.loss_nonfinite = False
        self.loss_sum, self.loss_count = 0.0, 0
        self.consecutive = 0
        self.skipped_total = 0

    def note_loss(self, loss: float | torch.Tensor) -> None:
        """Record a (micro-batch) loss of the current step."""
        value = float(loss)
        if not math.isfinite(value):
            self.loss_nonfinite = True
        self.loss_sum += value
        self.loss_count += 1

    def _agree(self, step_loss: float | None) -> tuple[bool, bool]:
        """(non-finite, spike) as all ranks see it: any rank's flag counts."""
        nonfinite = self.loss_nonfinite
        # fp16: inf gradients are loss-scale overflows, which DeepSpeed's scaler handles (and learns from)
        fp16 = bool(getattr(self.engine, "fp16_enabled", lambda: False)())
        if not nonfinite and not fp16:
            nonfinite = not _all_finite(list(_grads(self.engine)))
        spike = not nonfinite and self.spike is not None and step_loss is not None and self.spike.is_spike(step_loss)
        flags = torch.tensor([float(nonfinite), float(spike)])
        if mpu.world_size() > 1:
            mpu.all_reduce_max(flags)
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def take_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``_take_model_step``."""
        step_loss = self.loss_sum / self.loss_count if self.loss_count else None
        nonfinite, spike = self._agree(step_loss)
        self.loss_nonfinite, self.loss_sum, self.loss_count = False, 0.0, 0
        if not (nonfinite or spike):
            self.consecutive = 0
            if self.spike is not None and step_loss is not None:
                self.spike.record(step_loss)
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
        if mpu.world_rank() == 0:
            if nonfinite:
                logger.warning(
                    "iteration %d: non-finite loss or gradient, step skipped (%d in a row)", iteration, self.consecutive
                )
            else:
                assert self.spike is not None and step_loss is not None
                logger.warning(
                    "iteration %d: loss spike, step skipped (%d in a row): loss %.6g is %.1f standard deviations above "
                    "the last %d steps (loss_spike_skip_zscore %g)",
                    iteration, self.consecutive, step_loss, self.spike.zscore(step_loss) or 0.0,
                    len(self.spike.losses), self.spike.threshold,
                )  # fmt: skip
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteAbort(
                f"{self.consecutive} consecutive steps skipped for a non-finite loss or gradient or a loss spike (last "
                f"at iteration {iteration}): training diverged or the data is broken; lower the learning rate, check "
                "the data, or resume from an earlier checkpoint (max_consecutive_nonfinite_steps sets the limit)"
            )
        return None


def install_nonfinite_guard(
    engine: Any, max_consecutive: int, spike_window: int = 0, spike_zscore: float = 0.0
) -> NonFiniteGuard:
    """Wrap ``engine._take_model_step`` with a :class:`NonFiniteGuard` (stored as ``engine.nonfinite_guard``);
    ``spike_window`` > 0 also skips loss spikes above ``spike_zscore``."""
    spike = LossSpikeDetector(spike_window, spike_zscore) if spike_window > 0 else None
    guard = NonFiniteGuard(engine, max_consecutive, spike)
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
