"""The LR schedule's state in a checkpoint: where it is written and how a load restores it."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from megatron.checkpoint.layout import CheckpointError

logger = logging.getLogger(__name__)

LR_SCHEDULER_KEY = "lr_scheduler"  # where DeepSpeed writes an engine's LR schedule in mp_rank_XX_model_states.pt


class LRSchedule(Protocol):
    """What checkpointing uses of an LR schedule (``megatron.training.learning_rates.AnnealingLR``)."""

    def step(self, step_num: int | None = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def restore_lr_schedule(lr_scheduler: LRSchedule, state: Any, iteration: int, path: str) -> None:
    """The schedule as saved (GPT-NeoX's policy keys decide between it and the config); a checkpoint without one
    (written by a converter) resumes the configured schedule at the loaded iteration."""
    if state is None:
        logger.warning(
            "checkpoint %s has no LR scheduler state: the configured schedule resumes at iteration %d", path, iteration
        )
        lr_scheduler.step(iteration)
        return
    keys = sorted(lr_scheduler.state_dict())  # GPT-NeoX's AnnealingLR keys
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else keys
    steps = state.get("num_iters") if isinstance(state, dict) else None
    if missing or not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        problem = f"missing {', '.join(missing)}" if missing else f"num_iters={steps!r} is not a step count"
        raise CheckpointError(
            f"checkpoint {path}: its {LR_SCHEDULER_KEY!r} entry is not an LR schedule's state ({problem}; expected a "
            f"dict with {', '.join(keys)}); to start from its weights with a fresh schedule, set finetune: true"
        )
    lr_scheduler.load_state_dict(state)
