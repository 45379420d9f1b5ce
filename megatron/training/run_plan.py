"""The shape of a training run, decided once: :class:`RunPlan`.

``pretrain()`` builds one plan from the validated NeoXArgs and hands it to what needs the decision (model builder,
``deepspeed.initialize``, the step variant, checkpoint validation), so "pipeline or not", the parameter dtype, the
batch shape and the training objective's step are each read from the configuration in one place (the ZeRO stage is
the parallel layout's: ``ParallelConfig``, which the optimizer config receives it from). Every field has a reader
(``tests/unit/test_run_plan.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from megatron.config_utils import neox_values
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.precision import dtype_of_precision
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.model import PrecisionKeys, SequenceKeys
from megatron.neox_arguments.sections.training import TrainImplKeys

logger = logging.getLogger("megatron.train")

StepVariant = Literal["pipe", "sequential", "post_training"]


@dataclass(kw_only=True)  # not frozen: the schema classes it inherits are not
class RunPlan(PrecisionKeys, TrainImplKeys, BatchSizeKeys, SequenceKeys):
    """What kind of run this is; every field is derived from validated keys and never changes during the run."""

    pipeline: bool  # DeepSpeed PipelineModule + PipelineEngine (``pipe_parallel_size >= 1``: ``is_pipe_parallel``)
    validate_with_forward: bool  # ``checkpoint_validation_with_forward_pass`` where it can run (not under pipelines)

    # decisions, not config keys: the pipeline engine (``is_pipe_parallel``), forward validation
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("pipeline", "validate_with_forward")

    @classmethod
    def from_neox_args(cls, args: NeoXArgs) -> RunPlan:
        """The plan of a validated configuration (derived keys included)."""
        pipeline = args.is_pipe_parallel
        validate = args.checkpoint_validation_with_forward_pass
        if validate and pipeline:
            logger.warning("checkpoint_validation_with_forward_pass is not supported with pipe_parallel_size >= 1")
        return cls(**neox_values(cls, args), pipeline=pipeline, validate_with_forward=validate and not pipeline)

    @property
    def step_variant(self) -> StepVariant:
        """The training step: DeepSpeed's pipeline schedule, the sequential step, or a post-training objective
        (validation refuses post-training objectives under pipelines)."""
        if self.pipeline:
            return "pipe"
        return "sequential" if self.train_impl == "normal" else "post_training"

    @property
    def params_dtype(self) -> torch.dtype:
        """torch dtype of the parameters."""
        return dtype_of_precision(self.precision)

    @property
    def reward_head(self) -> bool:
        """Whether the model ends in a reward head (``train_impl: rm``; validation refuses it under pipelines)."""
        return self.train_impl == "rm"
