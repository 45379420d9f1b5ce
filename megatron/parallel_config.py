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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# the one megatron layer imported: its fields take their defaults from the schema (config_utils.from_schema)
from megatron.config_utils import NeoXValues, from_schema, schema_defaults


@dataclass
@schema_defaults
class ParallelConfig:
    """The parallelism keys of a run (GPT-NeoX names)."""

    model_parallel_size: int = from_schema()
    """Tensor-parallel degree."""
    pipe_parallel_size: int = from_schema()
    """Pipeline stages; 0 = no pipeline engine, 1 = GPT-NeoX's single-stage pipe engine."""
    sequence_parallel: bool = from_schema()
    """Megatron sequence parallelism (only meaningful with model_parallel_size > 1)."""
    zero_stage: int = from_schema()
    """``zero_optimization.stage`` as the config layer derived it (``derive.py``): the one owner of the stage among
    the module configs. The optimizer receives it from here (``OptimizerConfig.from_neox_args(args, layout)``); the
    checkpoint code reads what the engine runs (``engine.zero_optimization_stage()``)."""

    @property
    def pipeline(self) -> bool:
        """True when the DeepSpeed pipeline engine runs (``pipe_parallel_size >= 1``)."""
        return self.pipe_parallel_size >= 1

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> ParallelConfig:
        """Read every field strictly under its NeoX key (``zero_stage``: the config layer's copy of
        ``zero_optimization.stage``)."""
        return cls(
            model_parallel_size=args.model_parallel_size,
            pipe_parallel_size=args.pipe_parallel_size,
            sequence_parallel=args.sequence_parallel,
            zero_stage=args.zero_stage,
        )

    def pipeline_section(self) -> dict[str, bool]:
        """The DeepSpeed ``pipeline`` entries this layout needs."""
        replicated = not (self.sequence_parallel and self.model_parallel_size > 1)
        return {"pipe_partitioned": replicated, "grad_partitioned": replicated}

    def apply(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``ds_config`` with the ``pipeline`` entries set; an explicit contradicting value is an error."""
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
        return out
