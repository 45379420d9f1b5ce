"""Typed dataclasses, one per config section, holding GPT-NeoX's keys with GPT-NeoX's names and defaults."""

from __future__ import annotations

from megatron.neox_arguments.sections.deepspeed import DeepspeedConfigArgs, DeepspeedRunnerArgs
from megatron.neox_arguments.sections.logging import LoggingArgs
from megatron.neox_arguments.sections.model import ModelArgs
from megatron.neox_arguments.sections.optimizer import LRSchedulerArgs, MoEArgs, OptimizerArgs
from megatron.neox_arguments.sections.other import OtherArgs, ParallelismArgs, TokenizerArgs
from megatron.neox_arguments.sections.textgen import TextgenArgs
from megatron.neox_arguments.sections.training import TrainingArgs

# Section name -> dataclass, in the order they are documented.
SECTIONS: dict[str, type] = {
    "parallelism": ParallelismArgs,
    "model": ModelArgs,
    "moe": MoEArgs,
    "optimizer": OptimizerArgs,
    "lr_scheduler": LRSchedulerArgs,
    "tokenizer": TokenizerArgs,
    "training": TrainingArgs,
    "logging": LoggingArgs,
    "textgen": TextgenArgs,
    "deepspeed_config": DeepspeedConfigArgs,
    "deepspeed_runner": DeepspeedRunnerArgs,
    "other": OtherArgs,
}

__all__ = [
    "SECTIONS",
    "DeepspeedConfigArgs",
    "DeepspeedRunnerArgs",
    "LRSchedulerArgs",
    "LoggingArgs",
    "MoEArgs",
    "ModelArgs",
    "OptimizerArgs",
    "OtherArgs",
    "ParallelismArgs",
    "TextgenArgs",
    "TokenizerArgs",
    "TrainingArgs",
]
