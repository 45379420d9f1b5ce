"""Which layers each pipeline stage runs, and when the planner suggests the default (even) split instead.

DeepSpeed's ``PipelineModule`` weighs each spec of the layer list with ``type:<regex>`` by the spec's class name
(a ``LayerSpec``'s type) or function name; GPT-NeoX's default ``type:transformer|mlp`` therefore also weighs the two
parameter-free functions ``_pre_transformer_block`` and ``_post_transformer_block`` around the layers, and 105
layers on 35 stages split 4 on one stage and 2 or 3 on the others (one stage 1.33x slower). neox-forge's default
``type:transformerlayer|mlp`` weighs the layers only, so layers that divide by the stages split evenly
(``tests/unit/test_pipe_partition.py`` checks both against the real ``PipelineModule``).
"""

from __future__ import annotations

import re
from dataclasses import fields
from functools import cache
from itertools import pairwise

from megatron.checkpoint import partition_balanced, stage_bounds
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments.sections.other import LayerSplitKeys

FIRST_LAYER_SPEC = 2  # GPT-NeoX spec indices: embedding 0, function 1, layers 2 .. L+1
PARAMETER_FREE_SPECS = ("_pre_transformer_block", "_post_transformer_block")
LAYER_SPEC_NAMES = {  # the class DeepSpeed sees for each layer kind (megatron/model/gpt2_model.py)
    "mamba": "ParallelMambaResidualLayerPipe",
    "gmlp": "GMLPBlock",
    "amlp": "GMLPBlock",
    "rwkv": "RWKVResidualLayerPipe",
}


def default_partition_method() -> str:
    """neox-forge's default ``pipe_partition_method`` (the schema's)."""
    return str(next(f.default for f in fields(LayerSplitKeys) if f.name == "pipe_partition_method"))


def layers_by_stage(cfg: GPTModelConfig, pp: int, method: str | None = None) -> list[int]:
    """Transformer (or Mamba, RWKV, gMLP) layers on each of ``pp`` stages, as DeepSpeed partitions them."""
    if pp < 1:
        return [cfg.num_layers]
    bounds = stage_bounds(cfg, pp, method)
    first, last = FIRST_LAYER_SPEC, FIRST_LAYER_SPEC + cfg.num_layers
    return [max(0, min(hi, last) - max(lo, first)) for lo, hi in pairwise(bounds)]


def _matched_layers(cfg: GPTModelConfig, method: str) -> tuple[bool, frozenset[int]] | None:
    """For a ``type:`` method: (does it weigh a parameter-free function, the layer indices it weighs)."""
    if not method.lower().startswith("type:"):
        return None
    regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
    functions = any(regex.search(name) for name in PARAMETER_FREE_SPECS)
    names = [LAYER_SPEC_NAMES.get(kind, "ParallelTransformerLayerPipe") for kind in cfg.layer_types]
    return functions, frozenset(i for i, name in enumerate(names) if regex.search(name))


def even_split_method(cfg: GPTModelConfig, method: str) -> str:
    """The method ``--search`` plans pipelines with: the default when ``method`` is a ``type:`` regex that also
    weighs the parameter-free functions and the default weighs the same layers; else ``method`` itself."""
    default = default_partition_method()
    configured, even = _matched_layers(cfg, method), _matched_layers(cfg, default)
    if configured is None or even is None or not configured[0] or configured[1] != even[1]:
        return method
    return default


def uneven_split_warning(cfg: GPTModelConfig, pp: int, method: str) -> str | None:
    """A warning when ``method`` puts more layers on a stage than :func:`even_split_method` would."""
    better = even_split_method(cfg, method)
    if pp < 2 or better == method:
        return None
    ours, even = layers_by_stage(cfg, pp, method), layers_by_stage(cfg, pp, better)
    if max(ours) <= max(even):
        return None
    return (
        f"pipe_partition_method {method!r} puts {max(ours)} layers on a stage and {min(ours)} on another (it also "
        f"weighs the parameter-free {' and '.join(PARAMETER_FREE_SPECS)}, as GPT-NeoX does): the busiest stage "
        f"sets the pace; {better!r} (neox-forge's default) gives at most {max(even)} per stage"
    )


@cache
def gpt_neox_layers_per_stage(num_layers: int, pp: int) -> int:
    """The busiest stage's layers under GPT-NeoX's default partition of a plain transformer (a published GPT-NeoX
    run): DeepSpeed's balanced partition of the spec weights ``[0, 1, 1 × num_layers, 1, 0, 0]``."""
    weights = [0, 1] + [1] * num_layers + [1, 0, 0]
    bounds = partition_balanced(weights, pp)  # DeepSpeed's boundaries (megatron/checkpoint/partition.py)
    first, last = FIRST_LAYER_SPEC, FIRST_LAYER_SPEC + num_layers
    return max(max(0, min(hi, last) - max(lo, first)) for lo, hi in pairwise(bounds))
