"""The full (tp=1, unpartitioned) GPT-NeoX state dict of a model running under any TP × PP × DP × ZeRO layout.

Names are GPT-NeoX's ``sequential.{idx}.<name>`` (spec indices: embedding 0, layers 2..L+1, final norm L+3, untied
head L+4), whatever the execution: ``GPTSequential`` (``sequential.{idx}.``), a DeepSpeed ``PipelineModule``
(``{idx}.`` and ``tied_modules.{key}.``, the tied weights named after the first spec that uses the key) or either
wrapped by a DeepSpeed engine (``module.``). Tensor-parallel shards are merged with their ``partition_dim`` /
``partition_stride`` / ``partition_sizes`` attributes (or, for parameters without them, the model's
:func:`megatron.model.tp_sharding.partition_spec`); ZeRO-3 parameters are gathered first; pipeline stages are
collected over the pipe group. Meant for tests, layout changes and exports of models that fit in host memory.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.tp_sharding import check_reshardable, partition_spec

_PIPE_NAME = re.compile(r"^(\d+)\.(.+)$")
_TIED_NAME = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


def _unwrap(model: Any) -> nn.Module:
    """The model inside a DeepSpeed engine (or the model itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def tied_spec_indices(module: nn.Module) -> dict[str, int]:
    """``{tied key: index of the first spec using it}`` for a ``PipelineModule`` (empty for other modules)."""
    from deepspeed.pipe import TiedLayerSpec

    indices: dict[str, int] = {}
    for idx, spec in enumerate(getattr(module, "_layer_specs", []) or []):
        if isinstance(spec, TiedLayerSpec):
            indices.setdefault(spec.key, idx)
    return indices


def tied_parameter_names(module: nn.Module) -> list[str]:
    """Names (as in ``module.named_parameters()``) of the weights a ``PipelineModule`` ties across stages."""
    attrs = getattr(module, "tied_weight_attrs", None) or {}
    tied_modules = getattr(module, "tied_modules", None) or {}
    by_id = {id(p): name for name, p in module.named_parameters()}
    names = []
    for key, attr_names in attrs.items():
        for attr in attr_names:
            weight: Any = tied_modules[key]
            for part in attr.split("."):
                weight = getattr(weight, part)
            if id(weight) in by_id:
                names.append(by_id[id(weight)])
    return names


def neox_parameter_name(name: str, tied_indices: dict[str, int] | None = None) -> str:
    """Map a parameter name of any execution to GPT-NeoX's ``sequential.{idx}.<name>``.

    Raises ``ValueError`` for a name that belongs to no layer spec (or an unknown tied key).
    """
    name = name.removeprefix("module.")
    if name.startswith("sequential."):
        return name
    match = _PIPE_NAME.match(name)
    if match:
        return f"sequential.{int(match.group(1))}.{match.group(2)}"
    match = _TIED_NAME.match(name)
    if match:
        key = match.group(1)
        if tied_indices is None or key not in tied_indices:
            raise ValueError(f"parameter {name!r}: tied key {key!r} is not used by any layer spec")
        return f"sequential.{tied_indices[key]}.{match.group(2)}"
    raise ValueError(f"parameter {name!r} does not belong to a GPT-NeoX layer spec")


def _partitioning(
    name: str, param: torch.Tensor, cfg: GPTModelConfig | None
) -> tuple[int, int, tuple[int, ...] | None] | None:
    """``(dim, stride, sub_sizes)`` of a TP-sharded parameter, None if it is replicated."""
    if getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False):
        sizes = getattr(param, "partition_sizes", None)
        return int(getattr(param, "partition_dim")), int(getattr(param, "partition_stride", 1)), sizes  # noqa: B009
    if cfg is not None:
        dim, subs = partition_spec(name, cfg)
        if dim is not None:
            return dim, 1, subs
    return None


def _zero3_gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def gather_full_state_dict(
    model: Any, cfg: GPTModelConfig | None = None, *, dst: int | None = 0
) -> dict[str, torch.Tensor] | None:
    """Collect the full tp=1 weights (fp32 CPU copies, GPT-NeoX names) of ``model``; collective over the world.

    ``model``: ``GPTSequential``, ``GPT2ModelPipe`` or a DeepSpeed engine holding one. ``cfg`` is only needed
    for TP-sharded parameters that do not carry partition attributes. Returns the dict on global rank ``dst``
    (on every rank when ``dst`` is None) and None elsewhere.
    """
    module = _unwrap(model)
    tied = tied_spec_indices(module)
    named = list(module.named_parameters())
    tp = mpu.get_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    with _zero3_gathered([p for _, p in named]):
        for name, param in named:
            key = neox_parameter_name(name, tied)
            check_reshardable(key, tp)  # a gMLP block at TP > 1 has no tp=1 equivalent
            tensor = param.detach().to("cpu", torch.float32).clone()
            spec = _partitioning(key, param, cfg) if tp > 1 else None
            if spec is not None:
                dim, stride, sizes = spec
                shards = mpu.all_gather_tensors(tensor, group="model")
                tensor = mpu.merge_shards([s.cpu() for s in shards], dim, stride=stride, sub_sizes=sizes)
            local.setdefault(key, tensor)
    full = local
    if mpu.get_pipe_parallel_world_size() > 1:
        stages: list[Any] = mpu.all_gather_objects(local, group="pipe")
        tied_names = {neox_parameter_name(n, tied) for n in tied_parameter_names(module)}
        full = {}
        # A tied module lives on several stages: its tied weights are kept identical by DeepSpeed (checked here);
        # its other parameters (e.g. the learned position embeddings of the embedding module reused as the head)
        # are unused copies on the later stages, so the first stage's copy is the model's.
        for stage in stages:
            for key, tensor in stage.items():
                if key in full and key in tied_names and not torch.equal(full[key], tensor):
                    diff = (full[key] - tensor).abs().max().item()
                    raise RuntimeError(f"the pipeline stages' copies of tied weight {key} differ (by up to {diff})")
                full.setdefault(key, tensor)
    if dst is not None and mpu.world_rank() != dst:
        return None
    return dict(sorted(full.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(name: str) -> tuple[int, str]:
    match = re.match(r"^sequential\.(\d+)\.(.+)$", name)
    return (int(match.group(1)), match.group(2)) if match else (-1, name)
