"""The model's exact parameter shapes without allocating it: the model built on the meta device."""

from __future__ import annotations

import math

import torch

from megatron import mpu
from megatron.model.config import GPTModelConfig

_CACHE: dict[str, dict[str, tuple[int, ...]]] = {}  # by the config's repr and the TP world size


def meta_param_shapes(cfg: GPTModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every parameter, in registration order (a tied output layer adds none).

    Full (tp=1) shapes unless ``mpu`` is initialised with tensor parallelism, where the layers build this rank's
    shards.
    """
    from megatron.model.gpt2_model import build_sequential_model

    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    key = f"{tp}:{cfg!r}"
    if key not in _CACHE:
        with torch.device("meta"):
            model = build_sequential_model(cfg)
        if len(_CACHE) > 8:
            _CACHE.clear()
        _CACHE[key] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return dict(_CACHE[key])


def count_parameters(shapes: dict[str, tuple[int, ...]]) -> int:
    """Total number of elements of ``shapes``."""
    return sum(math.prod(shape) for shape in shapes.values())
