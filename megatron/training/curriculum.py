"""Sequence-length curriculum learning (``curriculum_learning``, GPT-NeoX's DeepSpeed curriculum).

DeepSpeed's own ``CurriculumScheduler`` gives the sequence length of every training iteration: before iteration
``i`` (1-based: ``iteration + 1``, as DeepSpeed's engine and GPT-NeoX's ``get_batch_pipe`` ask it) the step calls
``update_difficulty(i)``, and every micro-batch of the iteration is cut to that length: tokens,
labels, loss mask and position ids to ``[:, :L]``, the attention mask to ``[..., :L, :L]`` (GPT-NeoX's truncation).
Evaluation batches keep the full ``seq_length``.

The schedule is a function of the iteration, so a checkpoint needs no state of its own: on resume the scheduler is
advanced to the loaded iteration (``update_difficulty(iteration)``, as GPT-NeoX does), and the next iteration asks
for ``iteration + 1`` as the uninterrupted run did. The block stays out of the DeepSpeed config: DeepSpeed 0.19
removed its legacy top-level ``curriculum_learning`` and rejects it (DeeperSpeed's engine drove the schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

from megatron.config_utils import NeoXValues, neox_values
from megatron.neox_arguments.curriculum_checks import curriculum_enabled
from megatron.neox_arguments.sections.deepspeed import CurriculumKeys

# step.Batch: ((tokens, position_ids, attention_mask), (labels, loss_mask))
Batch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CurriculumConfig(CurriculumKeys):
    """The ``curriculum_learning`` block (validated with the config: ``neox_arguments/curriculum_checks.py``)."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> CurriculumConfig:
        """Read every field strictly under its NeoX key."""
        return cls(**neox_values(cls, args))

    @property
    def enabled(self) -> bool:
        """``curriculum_learning.enabled`` is true."""
        return curriculum_enabled(self.curriculum_learning)


class SeqlenCurriculum:
    """DeepSpeed's ``CurriculumScheduler`` for the sequence length, advanced once per training iteration."""

    def __init__(self, block: dict[str, Any], start_iteration: int = 0) -> None:
        self.scheduler = CurriculumScheduler(block)
        self.iteration = start_iteration  # training iterations done (the loaded checkpoint's on resume)
        self.seqlen: int = int(self.scheduler.state["current_difficulty"])  # min_difficulty
        if start_iteration > 0:  # resume: where the uninterrupted run's scheduler stands after that iteration
            self.seqlen = int(self.scheduler.update_difficulty(start_iteration))

    def advance(self) -> int:
        """The sequence length of the next training iteration (``update_difficulty(iteration + 1)``)."""
        self.iteration += 1
        self.seqlen = int(self.scheduler.update_difficulty(self.iteration))
        return self.seqlen


def build_curriculum(cfg: CurriculumConfig, start_iteration: int) -> SeqlenCurriculum | None:
    """The run's curriculum, or None when ``curriculum_learning`` is off."""
    if not cfg.enabled:
        return None
    assert cfg.curriculum_learning is not None
    return SeqlenCurriculum(cfg.curriculum_learning, start_iteration)


def truncate(batch: Batch, seqlen: int) -> Batch:
    """``batch`` cut to its first ``seqlen`` positions (unchanged when it is no longer than that)."""
    (tokens, position_ids, attention_mask), (labels, loss_mask) = batch
    if seqlen >= tokens.size(1):
        return batch

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, :seqlen].contiguous()

    mask = attention_mask[..., :seqlen, :seqlen].contiguous()
    return (cut(tokens), cut(position_ids), mask), (cut(labels), cut(loss_mask))
