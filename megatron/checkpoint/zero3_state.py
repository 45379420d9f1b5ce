"""Optimizer state of one model-parallel rank of a ZeRO-3 checkpoint, per parameter.

Each ``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` holds DP rank D's flat fp32 sub-groups (``fp32_flat_groups``)
and the torch optimizer state of each sub-group (``exp_avg`` … of the same flat size). Every parameter is cut into
``ceil(numel / dp)``-sized pieces (the last one zero-padded); rank D's flat buffers are its pieces of all parameters
concatenated, sub-group after sub-group. Parameter order and shapes are the ``param_shapes`` of the model-states
files (one ordered dict per param group). A parameter's state is its pieces concatenated in DP order, trimmed to
``numel``. This is the layout DeepSpeed's ``zero_to_fp32`` reads for the weights; a test checks the fp32 master
gathered here against it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.reader import load_torch

MASTER_KEY = "fp32_master"  # the fp32 weights, in the result of zero3_rank_state only (the weights come elsewhere)


def _model_states(optim_path: Path) -> Path:
    return optim_path.with_name(optim_path.name.replace("_optim_states.pt", "_model_states.pt"))


def zero3_rank_state(
    optim_states: list[dict[str, Any]], paths: list[Path]
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``({DeepSpeed parameter name: {state key: flat tensor of numel values or scalar, MASTER_KEY: weights}},
    [hyper-parameters of each sub-group])`` of one MP rank from its DP ranks' ``optimizer_state_dict``s."""
    dp = len(optim_states)
    model_path = _model_states(paths[0])
    if not model_path.is_file():
        raise CheckpointError(f"{model_path} is missing: the ZeRO-3 parameter order and shapes are stored there")
    param_shapes = load_torch(model_path).get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointError(f"{model_path.name}: no ZeRO-3 'param_shapes' (a list of name → shape per group)")
    flats: list[dict[str, torch.Tensor]] = []
    sizes: list[int] = []
    for path, osd in zip(paths, optim_states):
        inner, groups = osd.get("optimizer_state_dict"), osd.get("fp32_flat_groups")
        if int(osd.get("partition_count", 0)) != dp or not isinstance(inner, dict) or not isinstance(groups, list):
            raise CheckpointError(f"{path.name}: not a ZeRO-3 optimizer shard of {dp} data-parallel ranks")
        sizes = [int(g.numel()) for g in groups]
        states = [inner["state"].get(g) or {} for g in range(len(groups))]
        keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        if any(not all(torch.is_tensor(s.get(k)) for k in keys) for s in states):
            raise CheckpointError(f"{path.name}: the ZeRO-3 sub-groups do not all hold optimizer state {keys}")
        flat = {key: torch.cat([s[key].reshape(-1) for s in states]) for key in keys}
        flats.append({**flat, MASTER_KEY: torch.cat([g.reshape(-1) for g in groups])})
    first_inner = optim_states[0]["optimizer_state_dict"]
    scalars = [
        {k: v for k, v in (first_inner["state"].get(g) or {}).items() if not (torch.is_tensor(v) and v.dim() > 0)}
        for g in range(len(sizes))
    ]
    hparams = [{k: v for k, v in group.items() if k != "params"} for group in first_inner["param_groups"]]
    bounds = list(itertools.accumulate(sizes))
    out: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, shape in itertools.chain.from_iterable(g.items() for g in param_shapes):
        numel = math.prod(shape)
        part = math.ceil(numel / dp)
        sub_group = bisect.bisect_right(bounds, offset)
        if sub_group >= len(sizes) or offset + part > bounds[sub_group]:
            raise CheckpointError(f"{paths[0].parent}: ZeRO-3 partitions end before parameter {name} ({shape})")
        state: dict[str, Any] = dict(scalars[sub_group])
        for key in flats[0]:
            state[key] = torch.cat([f[key].narrow(0, offset, part) for f in flats])[:numel].clone()
        out[name] = state
        offset += part
    if offset != sum(sizes):
        raise CheckpointError(
            f"{paths[0].parent}: the ZeRO-3 parameters of {model_path.name} fill {offset} of {sum(sizes)} values "
            "of each rank's partition"
        )
    return out, hparams
