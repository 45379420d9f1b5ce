"""The config keys lm-eval evaluation reads (``eval.py`` and ``eval_tasks`` during training)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_utils import NeoXValues, neox_values
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.model import SequenceKeys
from megatron.neox_arguments.sections.other import ParallelSizeKeys, SeedKeys
from megatron.neox_arguments.sections.textgen import EvalHarnessKeys
from megatron.neox_arguments.sections.training import EvalLimitKeys


@dataclass
class EvalConfig(EvalHarnessKeys, EvalLimitKeys, SeedKeys, SequenceKeys, BatchSizeKeys, ParallelSizeKeys):
    """What the evaluation adapter and lm-eval's ``simple_evaluate`` need (GPT-NeoX key names)."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> EvalConfig:
        """Read every field strictly under its NeoX key (values as set, ``None`` included)."""
        return cls(**neox_values(cls, args))

    @property
    def max_length(self) -> int:
        """The longest request in tokens: ``max_position_embeddings``."""
        return self.max_position_embeddings

    @property
    def micro_batch_size(self) -> int:
        """Requests scored per forward."""
        return self.train_micro_batch_size_per_gpu
