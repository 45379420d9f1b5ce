"""Optimizer state of ZeRO-1/2/3 and bf16-optimizer checkpoints per parameter (resharding, carrying on load).

ZeRO-1/2 (``zero_pp_rank_D_mp_rank_XX_optim_states.pt``) and the bf16 optimizer (``bf16_zero_pp_rank_…``, the
same content) keep DP rank D's slice of flat per-group fp32 buffers and ``param_slice_mappings``: parameter name →
``(start, numel)`` of its fragment in that slice. ZeRO-3 shards are read by ``zero3_state``. A parameter's state is
its fragments concatenated in DP order, reshaped to the parameter's (TP-shard) shape. Names are DeepSpeed module
names (``sequential.<idx>.…`` for a sequential model; ``<idx>.…`` and ``tied_modules.embed.…`` for a pipe).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.optimizer_state import FullOptimizerState, merge_per_rank
from megatron.checkpoint.reader import load_torch
from megatron.checkpoint.zero3_state import MASTER_KEY, zero3_rank_state
from megatron.model.config import GPTModelConfig

ZERO_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def zero_optimizer_files(directory: Path) -> dict[int, list[Path]]:
    """``{mp_rank: [files in DP order]}`` of the ZeRO optimizer shards in a checkpoint directory."""
    found: dict[int, dict[int, Path]] = {}
    for path in directory.iterdir():
        m = ZERO_OPTIM_RE.match(path.name)
        if m:
            found.setdefault(int(m.group(3)), {})[int(m.group(2))] = path
    out = {}
    for mp, by_dp in found.items():
        if sorted(by_dp) != list(range(len(by_dp))):
            raise CheckpointError(f"{directory}: ZeRO optimizer shards of mp_rank {mp:02d} miss DP ranks")
        out[mp] = [by_dp[d] for d in range(len(by_dp))]
    return out


def full_param_name(name: str) -> str:
    """DeepSpeed module name of a parameter → full-layout key ``sequential.<idx>.<name>``."""
    name = name.removeprefix("module.")
    if name.startswith("tied_modules.embed."):
        return "sequential.0." + name[len("tied_modules.embed.") :]
    if name.startswith("sequential."):
        return name
    head, _, rest = name.partition(".")
    if head.isdigit():
        return f"sequential.{int(head)}.{rest}"
    raise CheckpointError(f"unexpected parameter name {name!r} in a ZeRO optimizer shard")


def _zero12_rank_state(
    optim_states: list[dict[str, Any]], paths: list[Path]
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """ZeRO-1/2 and bf16-optimizer shards of one MP rank → ``({name: {key: flat tensor or scalar}}, [group
    hyper-parameters])``: each parameter's fragments concatenated in DP order."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    hparams: list[dict[str, Any]] = []
    for path, osd in zip(paths, optim_states):
        base, mappings = osd.get("base_optimizer_state"), osd.get("param_slice_mappings")
        if not isinstance(base, dict) or mappings is None:
            raise CheckpointError(f"{path.name}: not a ZeRO-1/2 optimizer shard with parameter mappings")
        for g, mapping in enumerate(mappings):
            group = base["param_groups"][g]
            hparams.append({k: v for k, v in group.items() if k != "params"})
            state = base["state"].get(g) or {}
            for name, frag in mapping.items():
                slot = pieces.setdefault(name, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        slot.setdefault(key, []).append(value.narrow(0, frag.start, frag.numel))
                    else:
                        scalars.setdefault(name, {})[key] = value
    out = {
        name: {**scalars.get(name, {}), **{k: torch.cat(v) for k, v in slot.items()}} for name, slot in pieces.items()
    }
    return out, hparams


def gather_zero_optimizer_state(
    directory: Path, cfg: GPTModelConfig, tp: int, shard_shapes: Callable[[str, int], tuple[int, ...]]
) -> FullOptimizerState:
    """Per-parameter full optimizer state of a ZeRO-1/2/3 or bf16-optimizer checkpoint (``CheckpointError`` if
    not one). The fp32 weights are not part of it: they come from the model files."""
    files = zero_optimizer_files(directory)
    if not files:
        raise CheckpointError(f"{directory} has no ZeRO optimizer shards")
    per_rank: dict[str, list[dict[str, Any] | None]] = {}
    full = FullOptimizerState()
    group_decays: list[float] = []
    for mp, paths in sorted(files.items()):
        tp_rank = mp % tp  # mp_rank = stage·tp + TP rank
        optim_states = [load_torch(path).get("optimizer_state_dict") or {} for path in paths]
        stages = {int(osd.get("zero_stage", 0)) for osd in optim_states}
        # the bf16 optimizer records stage 0 or 1; its shards have the ZeRO-1/2 form
        read = zero3_rank_state if stages == {3} else _zero12_rank_state
        states, hparams = read(optim_states, paths)
        for group in hparams:
            decay = float(group.get("weight_decay") or 0.0)
            group_decays.append(decay)
            full.group_hparams.setdefault("decay" if decay else "no_decay", group)
        for name, flat_state in states.items():
            key_name = full_param_name(name)
            shape = shard_shapes(key_name, tp)
            state: dict[str, Any] = {}
            for key, value in flat_state.items():
                if key == MASTER_KEY:
                    continue
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != torch.Size(shape).numel():
                        raise CheckpointError(
                            f"ZeRO state {key} of {key_name}: {value.numel()} values for shape {shape}"
                        )
                    value = value.reshape(shape).clone()
                state[key] = value
            ranks = per_rank.setdefault(key_name, [None] * tp)
            if ranks[tp_rank] is None:  # a tied copy on a later stage carries the same state
                ranks[tp_rank] = state
    if not any(group_decays):  # weight_decay 0: one group with every parameter (see _grouped)
        full.combined = True
        full.group_hparams = {"all": full.group_hparams.get("no_decay", {})}
    merge_per_rank(per_rank, cfg, full)
    return full
