"""The LR decay styles (``lr_decay_style``), one registry entry each: ``LR_SCHEDULES``.

A style is the learning rate after warmup, as a function of the schedule's point (:class:`DecayPoint`);
``AnnealingLR`` (``learning_rates.py``) handles warmup and the final ``max(lr, min_lr)`` for every style. The schema
lists the same names as the ``LR_DECAY_STYLES`` ``Literal`` (``neox_arguments/sections/optimizer.py``);
``tests/unit/test_registries.py`` fails until both agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron.registry import Registry


@dataclass(frozen=True)
class DecayPoint:
    """Where the schedule is: scheduler step ``n``, ``t = n − W`` steps after warmup, of ``span = T − W``."""

    n: int
    t: float
    span: float
    lr_max: float
    min_lr: float
    warmup_iter: float


DecayStyle = Callable[[DecayPoint], float]
"""The learning rate after warmup (before the ``min_lr`` floor) at a point."""

LR_SCHEDULES: Registry[DecayStyle] = Registry("lr_decay_style")


def _constant(p: DecayPoint) -> float:
    return p.lr_max


def _linear(p: DecayPoint) -> float:
    return p.lr_max * (p.span - p.t) / p.span if p.span > 0 else p.min_lr


def _cosine(p: DecayPoint) -> float:
    return p.min_lr + (p.lr_max - p.min_lr) / 2.0 * (math.cos(math.pi * p.t / p.span) + 1) if p.span > 0 else p.min_lr


def _exponential(p: DecayPoint) -> float:
    return p.lr_max * math.exp(-0.693 * p.t / p.span) if p.span > 0 else p.min_lr


def _inverse_sqrt(p: DecayPoint) -> float:
    return p.lr_max * math.sqrt(max(p.warmup_iter, 1.0) / max(p.n, 1))


LR_SCHEDULES.register("constant", _constant)
LR_SCHEDULES.register("linear", _linear)
LR_SCHEDULES.register("cosine", _cosine)
LR_SCHEDULES.register("exponential", _exponential)
LR_SCHEDULES.register("inverse_sqrt", _inverse_sqrt)
