"""Reshard the optimizer state of ZeRO-0 checkpoints (a torch optimizer ``state_dict`` in every ``mp_rank`` file).

Element-wise optimizer state (Adam's ``exp_avg``/``exp_avg_sq``, momentum …) has the shape of its parameter and
is split across TP ranks exactly like it, so it reshards with the weights' rules. What a torch state dict lacks is
the parameter names: its ``state`` is keyed by position in the param groups. The positions are rebuilt here from
what the training code does: parameters in module-registration order (a pipe stage lists DeepSpeed's
``tied_modules`` first, then its layers), split into a decayed group and a ``weight_decay: 0`` group (norms and
biases), by the rule the optimizer uses (``megatron.model.weight_decay``). Every mapped tensor's shape is
checked against its parameter's shard, so a wrong mapping is an error, never silent corruption.

ZeRO-1/2/3 and the bf16 optimizer keep flat partitions in ``zero_pp_rank_*`` files: those checkpoints are
resharded weights-only (see ``docs/checkpoints.md``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError, stage_bounds
from megatron.checkpoint.rules import merge_tensor, resize_vocab, split_tensor
from megatron.model.config import GPTModelConfig
from megatron.model.layer_sharing import first_position, is_shared, unique_layer
from megatron.model.meta import meta_param_shapes
from megatron.model.weight_decay import model_no_weight_decay_names

logger = logging.getLogger(__name__)


def model_param_names(cfg: GPTModelConfig) -> list[str]:
    """Full-layout parameter names in registration order (the tied output layer adds none)."""
    return list(meta_param_shapes(cfg))


def slice_param_names(cfg: GPTModelConfig, pp: int, stage: int, partition_method: str | None = None) -> list[str]:
    """Parameter names of pipeline ``stage`` (``pp == 0``: the whole sequential model) in optimizer order."""
    names = model_param_names(cfg)
    if pp == 0:
        return names
    return _stage_names(cfg, names, _spec_indices(names), stage_bounds(cfg, pp, partition_method), stage)


def stage_param_names(cfg: GPTModelConfig, pp: int, partition_method: str | None = None) -> list[list[str]]:
    """:func:`slice_param_names` of every stage (one stage for ``pp == 0``), the names parsed once."""
    names = model_param_names(cfg)
    if pp == 0:
        return [names]
    index, parts = _spec_indices(names), stage_bounds(cfg, pp, partition_method)
    return [_stage_names(cfg, names, index, parts, stage) for stage in range(pp)]


def _spec_indices(names: list[str]) -> list[int]:
    """The spec index of each ``sequential.<index>.…`` name."""
    return [int(n.split(".")[1]) for n in names]


def _stage_names(cfg: GPTModelConfig, names: list[str], index: list[int], parts: list[int], stage: int) -> list[str]:
    lo, hi = parts[stage], parts[stage + 1]
    head = cfg.num_layers + 4
    owned = [n for n, i in zip(names, index, strict=True) if lo <= i < hi]
    if is_shared(cfg):  # a stage holds each shared layer it runs, named after the layer's first position
        run = {first_position(cfg, unique_layer(cfg, i)) + 2 for i in range(cfg.num_layers) if lo <= i + 2 < hi}
        layers = range(2, cfg.num_layers + 2)
        owned = [n for n, i in zip(names, index, strict=True) if i in run] + [
            n for n in owned if int(n.split(".")[1]) not in layers
        ]
    if not cfg.tied_embeddings:
        return owned
    # DeepSpeed registers ``tied_modules`` before the layers; every stage with the embedding or the tied head holds
    # a copy of the whole embedding module.
    embed = [n for n in names if n.startswith("sequential.0.")]
    rest = [n for n in owned if not n.startswith("sequential.0.")]
    return embed + rest if (lo <= 0 < hi or lo <= head < hi) else rest


def _grouped(names: list[str], combined: bool, cfg: GPTModelConfig) -> list[tuple[str, list[str]]]:
    exempt = model_no_weight_decay_names(cfg)  # the optimizer's own rule (megatron.model.weight_decay)
    decay = [n for n in names if n not in exempt]
    no_decay = [n for n in names if n in exempt]
    if combined:
        return [("all", decay + no_decay)]
    return [(kind, group) for kind, group in (("decay", decay), ("no_decay", no_decay)) if group]


@dataclass
class FullOptimizerState:
    """Optimizer state per full-layout parameter name, plus the hyper-parameters of each kind of group."""

    per_param: dict[str, dict[str, Any]] = field(default_factory=dict)
    group_hparams: dict[str, dict[str, Any]] = field(default_factory=dict)
    combined: bool = False


def is_torch_optimizer_state(opt: Any) -> bool:
    """A plain ``torch.optim`` state dict (what DeepSpeed saves under ZeRO-0 without fp16/bf16 wrappers)."""
    return (
        isinstance(opt, dict)
        and set(opt) == {"state", "param_groups"}
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in opt["param_groups"])
    )


def gather_optimizer_state(
    optimizers: list[Any],
    shard_shapes: Callable[[str, int], tuple[int, ...]],
    cfg: GPTModelConfig,
    tp: int,
    pp: int,
    partition_method: str | None = None,
) -> FullOptimizerState:
    """Merge the per-slice optimizer states (``optimizers[stage·tp + tp_rank]``) into per-parameter full state."""
    if not optimizers or not all(is_torch_optimizer_state(o) for o in optimizers):
        raise CheckpointError("optimizer state is not a plain torch optimizer state dict (ZeRO / bf16 / none)")
    combined = all(len(o["param_groups"]) == 1 and not o["param_groups"][0].get("weight_decay") for o in optimizers)
    per_rank: dict[str, list[dict[str, Any] | None]] = {}
    full = FullOptimizerState(combined=combined)
    for stage in range(max(pp, 1)):
        names = slice_param_names(cfg, pp, stage, partition_method)
        for tp_rank in range(tp):
            opt = optimizers[stage * tp + tp_rank]
            groups = _grouped(names, combined, cfg)
            if [len(g) for _, g in groups] != [len(g["params"]) for g in opt["param_groups"]]:
                raise CheckpointError(
                    f"optimizer of stage {stage} TP rank {tp_rank}: param groups of sizes "
                    f"{[len(g['params']) for g in opt['param_groups']]} do not match the model's "
                    f"{[len(g) for _, g in groups]}"
                )
            for (kind, group_names), group in zip(groups, opt["param_groups"]):
                full.group_hparams.setdefault(kind, {k: v for k, v in group.items() if k != "params"})
                for name, index in zip(group_names, group["params"]):
                    state = opt["state"].get(index)
                    for key, value in (state or {}).items():
                        if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shard_shapes(name, tp):
                            raise CheckpointError(
                                f"optimizer state {key} of {name} has shape {tuple(value.shape)}, "
                                f"expected {shard_shapes(name, tp)}"
                            )
                    slot = per_rank.setdefault(name, [None] * tp)
                    if slot[tp_rank] is None:  # a tied copy on a later stage carries the same state
                        slot[tp_rank] = state
    merge_per_rank(per_rank, cfg, full)
    return full


def merge_per_rank(
    per_rank: dict[str, list[dict[str, Any] | None]], cfg: GPTModelConfig, full: FullOptimizerState
) -> None:
    """Merge each parameter's per-TP-rank state (element-wise tensors with the weight rules) into ``full``."""
    for name, states in per_rank.items():
        if any(s is None for s in states):
            continue  # the parameter never received a gradient (e.g. an unused tied copy)
        merged: dict[str, Any] = {}
        for key, value in states[0].items():  # type: ignore[union-attr]
            if torch.is_tensor(value) and value.dim() > 0:
                merged[key] = merge_tensor(name, [s[key] for s in states], cfg)  # type: ignore[index]
            else:
                merged[key] = value
        full.per_param[name] = merged


def resize_optimizer_vocab(full: FullOptimizerState, rows: int) -> None:
    """Pad/trim the vocabulary rows of the embedding / output-layer state in place."""
    for name, state in full.per_param.items():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = resize_vocab(name, value, rows)


def scatter_optimizer_state(
    full: FullOptimizerState, cfg: GPTModelConfig, tp: int, pp: int, partition_method: str | None = None
) -> Callable[[int, int], dict[str, Any]]:
    """``fn(stage, tp_rank)`` → the torch optimizer state dict of that slice in the target layout."""
    split_cache: dict[tuple[str, str], list[torch.Tensor]] = {}

    def state_for(stage: int, tp_rank: int) -> dict[str, Any]:
        names = slice_param_names(cfg, pp, stage, partition_method)
        groups, states, index = [], {}, 0
        for kind, group_names in _grouped(names, full.combined, cfg):
            if kind not in full.group_hparams:
                raise CheckpointError(f"source optimizer has no {kind!r} param group to copy hyper-parameters from")
            params = []
            for name in group_names:
                src = full.per_param.get(name)
                if src is not None:
                    state = {}
                    for key, value in src.items():
                        if torch.is_tensor(value) and value.dim() > 0:
                            if (name, key) not in split_cache:
                                split_cache[(name, key)] = [t.clone() for t in split_tensor(name, value, cfg, tp)]
                            state[key] = split_cache[(name, key)][tp_rank]
                        else:
                            state[key] = copy.deepcopy(value)
                    states[index] = state
                params.append(index)
                index += 1
            groups.append({**copy.deepcopy(full.group_hparams[kind]), "params": params})
        return {"state": states, "param_groups": groups}

    return state_for
