"""Exact parameter counts per rank: the model's tensors on the meta device, split by pipeline stage and TP.

A tensor that GPT-NeoX's tensor parallelism partitions (``partition_spec``) holds ``numel / tp`` elements on each
TP rank; the others are replicated. Pipeline stages own the layers DeepSpeed gives them (``stage_bounds``, the
configured ``pipe_partition_method``); with tied embeddings the first and last stage both hold the embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.checkpoint import stage_bounds, stage_param_names
from megatron.model.config import GPTModelConfig
from megatron.model.meta import count_parameters, meta_param_shapes
from megatron.model.tp_sharding import partition_spec

FIRST_LAYER_SPEC = 2  # GPT-NeoX spec indices: embedding 0, transformer layers 2 .. L+1


@dataclass(frozen=True)
class StageParams:
    """What one TP rank of one pipeline stage holds."""

    numels: tuple[int, ...]  # per parameter tensor, this rank's share
    num_layers: int  # transformer layers on the stage

    @property
    def total(self) -> int:
        """Parameters on the rank."""
        return sum(self.numels)


@dataclass(frozen=True)
class ParamCounts:
    """The whole model (``total``, tp=1, tied weights once) and every stage's per-rank share."""

    total: int
    stages: tuple[StageParams, ...]
    embedding: int  # word-embedding parameters (the vocabulary part)


def count_params(cfg: GPTModelConfig, tp: int, pp: int, partition_method: str | None = None) -> ParamCounts:
    """Count from the model built on the meta device (nothing is allocated, also for 100B+ models)."""
    shapes = meta_param_shapes(cfg)
    per_rank = {}
    for name, shape in shapes.items():
        dim = partition_spec(name, cfg)[0]
        per_rank[name] = math.prod(shape) // (tp if dim is not None else 1)
    layer_specs = range(FIRST_LAYER_SPEC, FIRST_LAYER_SPEC + cfg.num_layers)
    with torch.device("meta"):  # "parameters" partitioning builds each layer to weigh it
        bounds = stage_bounds(cfg, pp, partition_method) if pp >= 1 else [0, cfg.num_layers + 5]
        stages = []
        for stage, names in enumerate(stage_param_names(cfg, pp, partition_method)):
            layers = sum(1 for i in layer_specs if bounds[stage] <= i < bounds[stage + 1])
            stages.append(StageParams(tuple(per_rank[n] for n in names), layers))
    embedding = sum(math.prod(s) for n, s in shapes.items() if n.startswith("sequential.0.") and "word" in n)
    return ParamCounts(count_parameters(shapes), tuple(stages), embedding)
