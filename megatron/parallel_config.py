"""What a 3D layout (tensor × pipeline × data parallel, ZeRO, sequence parallel) requires of the DeepSpeed config.

Two rules GPT-NeoX leaves implicit:

* ZeRO stages 2 and 3 partition gradients/parameters, which DeepSpeed's pipeline engine does not support:
  ``pipe_parallel_size >= 1`` (including GPT-NeoX's single-stage pipe engine) needs ZeRO stage 0 or 1. The config
  layer refuses it (``neox_arguments/validate.py``, next to the keys, with the key ranges in ``ranges.py``); a
  ``ParallelConfig`` is built from validated arguments and does not check it again.
* The pipeline engine by default sends only ``1/tp`` of every activation (and gradient) between stages and
  all-gathers it on the other side, which is correct only when the activations are identical on every TP rank.
  With ``sequence_parallel`` each TP rank holds a different slice of the sequence, so that partitioning must be
  off (``pipeline.pipe_partitioned`` / ``pipeline.grad_partitioned``), or stages would receive a mix of slices.

And one DeepSpeed bug worked around: with more than one pipeline stage, DeepSpeed 0.19's pipeline engine starts its
backward timers on every stage but the last and then runs ``tensor.backward``, whose prologue starts them again
(``AssertionError: bwd_microstep timer has already been started``, whatever the model). So DeepSpeed's own
``wall_clock_breakdown`` is turned off there (one warning); neox-forge's ``time (ms)`` breakdown, which is its own
timers, still prints.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

# the megatron layers imported: config_utils, and the schema classes that declare its keys
from megatron.config_utils import NeoXValues, neox_values
from megatron.neox_arguments.sections.optimizer import ZeroKeys
from megatron.neox_arguments.sections.other import LayerSplitKeys, ParallelSizeKeys

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig(ParallelSizeKeys, LayerSplitKeys, ZeroKeys):
    """The parallelism keys of a run (GPT-NeoX names). Its ``zero_stage`` is ``zero_optimization.stage`` as the config
    layer derived it (``derive.py``): the one owner of the stage among the module configs. The optimizer receives it
    from here (``OptimizerConfig.from_neox_args(args, layout)``); the checkpoint code reads what the engine runs
    (``engine.zero_optimization_stage()``)."""

    @property
    def pipeline(self) -> bool:
        """True when the DeepSpeed pipeline engine runs (``pipe_parallel_size >= 1``)."""
        return self.pipe_parallel_size >= 1

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> ParallelConfig:
        """Read every field strictly under its NeoX key (``zero_stage``: the config layer's copy of
        ``zero_optimization.stage``)."""
        return cls(**neox_values(cls, args))

    def pipeline_section(self) -> dict[str, bool]:
        """The DeepSpeed ``pipeline`` entries this layout needs."""
        replicated = not (self.sequence_parallel and self.model_parallel_size > 1)
        return {"pipe_partitioned": replicated, "grad_partitioned": replicated}

    def apply(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``ds_config`` with the ``pipeline`` entries set (an explicit contradicting value is an error), and
        DeepSpeed's ``wall_clock_breakdown`` off with more than one pipeline stage (the module docstring says why)."""
        out = copy.deepcopy(ds_config)
        section = dict(out.get("pipeline") or {})
        for key, value in self.pipeline_section().items():
            if key in section and bool(section[key]) != value:
                raise ValueError(
                    f"deepspeed config pipeline.{key}: {section[key]} is wrong with sequence_parallel="
                    f"{self.sequence_parallel} and model_parallel_size={self.model_parallel_size}; it must be "
                    f"{value} (sequence-parallel activations differ across TP ranks)"
                )
            section[key] = value
        out["pipeline"] = section
        if self.pipe_parallel_size > 1 and out.get("wall_clock_breakdown"):
            logger.warning(
                "wall_clock_breakdown: DeepSpeed's own timers are off with pipe_parallel_size=%d (DeepSpeed 0.19's "
                "pipeline engine starts its backward timer twice on every stage but the last); the time (ms) "
                "breakdown of neox-forge's timers still prints",
                self.pipe_parallel_size,
            )
            out["wall_clock_breakdown"] = False
        return out
