"""The post-training step: :class:`AccumulatingStep` with the batch and loss of an objective chosen once at setup.

It lives in ``training`` (which composes the run and may import ``post_training``), not in ``post_training``, so that
``post_training`` (config, data, objectives) never imports ``training``: the two packages form no cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron.engine_protocol import Engine
from megatron.logging.timers import Timers
from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.objectives import DPOObjective, KTOObjective, RewardModelObjective, frozen_copy
from megatron.post_training.reinforce import ReinforceObjective
from megatron.training.learning_rates import AnnealingLR
from megatron.training.nonfinite import StepGuard
from megatron.training.step import AccumulatingStep, StepResult


class PostTrainStep(AccumulatingStep):
    """``gas`` × (objective batch, objective loss, backward, step); the objective's metrics are averaged over the
    iteration's micro-batches and all ranks and returned as ``train/<name>`` in ``StepResult.extra``."""

    def __init__(
        self,
        engine: Engine,
        objective: Any,
        gas: int,
        timers: Timers,
        lr_scheduler: AnnealingLR | None,
        guard: StepGuard,
    ) -> None:
        super().__init__(engine, gas, timers, lr_scheduler, guard)
        self.objective = objective
        self.metrics: list[dict[str, torch.Tensor]] = []

    def forward(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> torch.Tensor:
        """Forward one micro-batch; returns the objective's loss."""
        self.timers("batch generator").start()
        batch = self.objective.batch(next(data_iter) if data_iter is not None else None)
        self.timers("batch generator").stop()
        loss, metrics = self.objective.loss(self.engine, batch)
        self.metrics.append(metrics)
        return loss

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration; ``extra`` carries the metrics."""
        self.metrics = []
        return super().train(data_iter)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The objective's metrics, averaged over the iteration's micro-batches (device tensors: the step averages
        them over ranks in its one reduction)."""
        names = self.metrics[0].keys() if self.metrics else []
        return {f"train/{k}": torch.stack([m[k].float() for m in self.metrics]).mean() for k in names}


def build_post_training_step(
    cfg: PostTrainingConfig,
    engine: Engine,
    eod: int,
    gas: int,
    timers: Timers,
    lr_scheduler: AnnealingLR | None,
    guard: StepGuard,
) -> PostTrainStep:
    """The step for ``train_impl`` dpo/kto/rm/reinforce (``normal``, language modelling and SFT, uses
    ``SequentialStep``)."""
    # no frozen copy (a second model in memory) when there is no reference or it was precomputed
    needs_copy = not (cfg.reads_precomputed_reference or (cfg.train_impl == "dpo" and cfg.dpo_reference_free))
    reference = frozen_copy(engine.module) if needs_copy and cfg.train_impl in ("dpo", "kto") else None
    if cfg.train_impl == "dpo":
        return PostTrainStep(engine, DPOObjective(cfg, eod, reference), gas, timers, lr_scheduler, guard)
    if cfg.train_impl == "kto":
        return PostTrainStep(engine, KTOObjective(cfg, eod, reference), gas, timers, lr_scheduler, guard)
    if cfg.train_impl == "reinforce":  # GPT-NeoX: a frozen reference only with a KL penalty
        reference = frozen_copy(engine.module) if cfg.kl_div_beta > 0 else None
        return PostTrainStep(engine, ReinforceObjective(cfg, eod, reference), gas, timers, lr_scheduler, guard)
    if cfg.train_impl == "rm":
        return PostTrainStep(engine, RewardModelObjective(cfg, eod), gas, timers, lr_scheduler, guard)
    raise ValueError(f"train_impl {cfg.train_impl!r} has no post-training step")
