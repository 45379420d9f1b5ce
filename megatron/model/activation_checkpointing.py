"""DeepSpeed activation-checkpointing settings (GPT-NeoX's ``configure_deepspeed_activations_checkpointing``).

The model recomputes every ``checkpoint_num_layers`` transformer layers when ``checkpoint_activations`` is on (in
sequential and pipeline execution alike, through DeepSpeed's checkpoint function). How those checkpoints are
stored is DeepSpeed's global state, set once per process from GPT-NeoX's keys by the run's model setup (as
torchtitan applies activation checkpointing after building the model, not inside it: the model constructors change
no process-wide state, and this class is the only declaration of the storage keys):

* ``partition_activations``: each TP rank keeps 1/tp of every checkpointed input (all-gathered on recompute;
  refused with ``sequence_parallel``, whose activations are already split and differ per TP rank);
* ``contiguous_checkpointing``: partitions are copied into preallocated buffers (needs ``partition_activations``);
* ``checkpoint_in_cpu``: checkpoints are kept in host memory;
* ``synchronize_each_layer``: synchronise the accelerator around every checkpointed chunk;
* ``profile_backward``: time every checkpointed forward/backward.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_overrides, require_keys
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.model import ShapeKeys
from megatron.neox_arguments.sections.other import LayerSplitKeys, ParallelSizeKeys
from megatron.neox_arguments.sections.training import ActivationCheckpointKeys, RecomputeKeys

logger = logging.getLogger(__name__)


@dataclass
class ActivationCheckpointConfig(
    RecomputeKeys, ActivationCheckpointKeys, ShapeKeys, ParallelSizeKeys, BatchSizeKeys, LayerSplitKeys
):
    """GPT-NeoX keys of activation checkpointing."""

    def __post_init__(self) -> None:
        require_keys(self, ("num_layers",))  # required: the schema's default is None
        if not isinstance(self.checkpoint_num_layers, int) or self.checkpoint_num_layers < 1:
            raise ValueError(f"checkpoint_num_layers must be an integer >= 1, got {self.checkpoint_num_layers!r}")
        if self.contiguous_checkpointing and not self.partition_activations:
            raise ValueError(
                "contiguous_checkpointing: true needs partition_activations: true (DeepSpeed only keeps "
                "partitioned activations in contiguous buffers)"
            )

        if self.partition_activations and self.sequence_parallel:
            raise ValueError(
                "partition_activations: true cannot be combined with sequence_parallel: true: sequence-parallel "
                "activations are already split over the tensor-parallel group and differ per rank, while "
                "DeepSpeed's partitioning assumes identical copies (the recomputation would mix slices); set "
                "partition_activations: false"
            )

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> ActivationCheckpointConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        return cls(**values)

    @property
    def num_checkpoints(self) -> int:
        """Checkpointed chunks alive at once on one rank: chunks per forward × micro-batches in flight."""
        chunks = math.ceil(self.num_layers / self.checkpoint_num_layers)
        in_flight = min(max(self.gradient_accumulation_steps, 1), self.pipe_parallel_size) if self.pipeline else 1
        return max(chunks * in_flight, 1)

    @property
    def pipeline(self) -> bool:
        """True when a pipeline with several stages runs (several forwards before the first backward)."""
        return self.pipe_parallel_size > 1


def configure_activation_checkpointing(cfg: ActivationCheckpointConfig) -> bool:
    """Set DeepSpeed's activation-checkpointing state (collective-free); returns whether it was set.

    Call after :func:`megatron.mpu.initialize_model_parallel`. Every setting is written, so a later call fully
    replaces an earlier one. DeepSpeed needs ``torch.distributed``: without it (a plain single process) nothing is
    configured and checkpoints are kept unpartitioned in memory.
    """
    import deepspeed

    if not mpu.is_distributed():
        logger.debug("torch.distributed is not initialised: DeepSpeed activation checkpointing left unconfigured")
        return False

    deepspeed.checkpointing.configure(
        mpu,
        partition_activations=cfg.partition_activations,
        contiguous_checkpointing=cfg.contiguous_checkpointing,
        num_checkpoints=cfg.num_checkpoints,
        checkpoint_in_cpu=cfg.checkpoint_in_cpu,
        synchronize=cfg.synchronize_each_layer,
        profile=cfg.profile_backward,
    )
    logger.debug("activation checkpointing configured: %s", cfg)
    return True
