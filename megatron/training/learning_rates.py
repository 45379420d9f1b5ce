"""GPT-NeoX's annealing learning-rate schedule (``megatron/learning_rates.py::AnnealingLR``), restated.

With ``T`` decay iterations, ``W = warmup · T`` warmup iterations (a float) and ``n`` the scheduler step
(advanced by DeepSpeed after every optimizer step that was not skipped):

* warmup (``W > 0`` and ``n <= W``): ``lr = lr_max · max(1, n) / W``
* afterwards, with ``t = n − W`` and ``D = T − W``:
  ``constant``: ``lr_max``; ``linear``: ``lr_max · (D − t) / D``;
  ``cosine``: ``min_lr + (lr_max − min_lr) / 2 · (cos(π·t/D) + 1)``; ``exponential``: ``lr_max · exp(−0.693·t/D)``;
  ``inverse_sqrt`` (ours, not in GPT-NeoX): ``lr_max · sqrt(max(W, 1) / max(n, 1))``; each style is an entry of
  ``LR_SCHEDULES`` (``lr_schedules.py``)
* finally ``max(lr, min_lr)``; linear therefore decays towards 0 and is clipped at ``min_lr`` (GPT-NeoX quirk, kept).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron.config_utils import NeoXValues, neox_overrides
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.optimizer import LRKeys, LRSchedulerArgs
from megatron.neox_arguments.sections.training import IterationKeys, MupKeys
from megatron.training.lr_schedules import LR_SCHEDULES, DecayPoint

logger = logging.getLogger(__name__)


@dataclass
class LRScheduleConfig(LRSchedulerArgs, LRKeys, IterationKeys, MupKeys):
    """The GPT-NeoX keys that define the schedule."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> LRScheduleConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        return cls(**neox_overrides(cls, args))

    def decay_iters(self) -> int:
        """``T``: ``lr_decay_iters``, else ``floor(train_iters · lr_decay_fraction)``, else ``train_iters`` (≥ 1)."""
        if self.lr_decay_iters is not None:
            total = self.lr_decay_iters
        elif self.train_iters is None:
            raise ConfigError("the LR schedule needs train_iters or lr_decay_iters")
        elif self.lr_decay_fraction is not None:
            total = math.floor(self.train_iters * self.lr_decay_fraction)
        else:
            total = self.train_iters
        return max(total, 1)


def annealed_lr(n: int, *, lr_max: float, min_lr: float, warmup_iter: float, end_iter: int, decay_style: str) -> float:
    """The learning rate at scheduler step ``n`` (pure function of the schedule's parameters)."""
    if warmup_iter > 0 and n <= warmup_iter:
        return float(lr_max) * max(1, n) / warmup_iter
    try:
        style = LR_SCHEDULES.get(decay_style)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = n - warmup_iter
    point = DecayPoint(n=n, t=t, span=end_iter - warmup_iter, lr_max=lr_max, min_lr=min_lr, warmup_iter=warmup_iter)
    lr = style(point)
    return max(lr, min_lr)


class AnnealingLR:
    """Warmup then decay, stepped by DeepSpeed after every applied optimizer step.

    ``state_dict``/``load_state_dict`` use GPT-NeoX's keys (``start_lr, warmup_iter, num_iters, decay_style,
    end_iter, min_lr``), so DeepSpeed stores the schedule in ``mp_rank_XX_model_states.pt["lr_scheduler"]``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        cfg: LRScheduleConfig,
        last_iter: int = 0,
    ) -> None:
        if cfg.lr_decay_style not in LR_SCHEDULES:
            raise ConfigError(LR_SCHEDULES.unknown(cfg.lr_decay_style))
        if cfg.min_lr > cfg.lr:
            raise ConfigError(f"min_lr ({cfg.min_lr}) must not exceed lr ({cfg.lr})")
        if cfg.override_lr_scheduler and cfg.use_checkpoint_lr_scheduler:
            raise ConfigError("override_lr_scheduler and use_checkpoint_lr_scheduler cannot both be set")
        self.optimizer = optimizer
        self.start_lr = cfg.lr
        self.min_lr = cfg.min_lr
        self.end_iter = cfg.decay_iters()
        self.warmup_iter = cfg.warmup * self.end_iter
        self.decay_style = cfg.lr_decay_style
        self.override_lr_scheduler = cfg.override_lr_scheduler
        self.use_checkpoint_lr_scheduler = cfg.use_checkpoint_lr_scheduler
        self.use_mup = cfg.use_mup
        self.num_iters = last_iter
        self.step(last_iter)

    def get_lr(self) -> float:
        """The learning rate for the current scheduler step."""
        return annealed_lr(
            self.num_iters,
            lr_max=self.start_lr,
            min_lr=self.min_lr,
            warmup_iter=self.warmup_iter,
            end_iter=self.end_iter,
            decay_style=self.decay_style,
        )

    def get_last_lr(self) -> list[float]:
        """Per-group learning rates, as torch schedulers report them."""
        if self.optimizer is None:
            return [self.get_lr()]
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, step_num: int | None = None) -> None:
        """Advance to ``step_num`` (default: the next step) and write the lr into every param group."""
        self.num_iters = self.num_iters + 1 if step_num is None else int(step_num)
        new_lr = self.get_lr()
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            # muP scales the lr of hidden matrices by 1/width_mult.
            group["lr"] = new_lr / group["width_mult"] if self.use_mup and "width_mult" in group else new_lr

    def state_dict(self) -> dict[str, Any]:
        """GPT-NeoX's scheduler state."""
        return {
            "start_lr": self.start_lr,
            "warmup_iter": self.warmup_iter,
            "num_iters": self.num_iters,
            "decay_style": self.decay_style,
            "end_iter": self.end_iter,
            "min_lr": self.min_lr,
        }

    def _pick(self, current: Any, saved: Any, name: str) -> Any:
        if self.override_lr_scheduler:
            return current
        if self.use_checkpoint_lr_scheduler:
            return saved
        if current != saved:
            raise ConfigError(
                f"the checkpoint's LR scheduler has {name}={saved!r} but the config gives {current!r}; set "
                "override_lr_scheduler (use the config) or use_checkpoint_lr_scheduler (use the checkpoint)"
            )
        return current

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the step; the other values must match the config unless one of the two policies is set."""
        self.start_lr = self._pick(self.start_lr, sd["start_lr"], "start_lr (lr)")
        self.min_lr = self._pick(self.min_lr, sd["min_lr"], "min_lr")
        self.warmup_iter = self._pick(self.warmup_iter, sd["warmup_iter"], "warmup_iter (warmup · decay iters)")
        self.end_iter = self._pick(self.end_iter, sd["end_iter"], "end_iter (lr_decay_iters)")
        self.decay_style = self._pick(self.decay_style, sd["decay_style"], "decay_style (lr_decay_style)")
        self.step(int(sd["num_iters"]))
