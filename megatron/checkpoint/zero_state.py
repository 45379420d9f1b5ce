"""Optimizer state of ZeRO-1/2 checkpoints (fp32) per parameter, for resharding into the ZeRO-0 form.

Each ``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` holds DP rank D's slice of flat per-group buffers and
``param_slice_mappings``: parameter name → ``(start, numel)`` of its fragment in that slice. A parameter's state is
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
from megatron.model.config import GPTModelConfig

ZERO_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def zero_optimizer_files(directory: Path) -> dict[int, list[Path]]:
    """``{mp_rank: [files in DP order]}`` of the ZeRO optimizer shards in a checkpoint directory."""
    found: dict[int, dict[int, Path]] = {}
    for path in directory.iterdir():
        m = ZERO_OPTIM_RE.match(path.name)
        if m:
            if m.group(1):
                raise CheckpointError(f"{path.name}: bf16 ZeRO optimizer state is not resharded")
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


def gather_zero_optimizer_state(
    directory: Path, cfg: GPTModelConfig, tp: int, shard_shapes: Callable[[str, int], tuple[int, ...]]
) -> FullOptimizerState:
    """Per-parameter full optimizer state of a ZeRO-1/2 fp32 checkpoint (``CheckpointError`` if not one)."""
    files = zero_optimizer_files(directory)
    if not files:
        raise CheckpointError(f"{directory} has no ZeRO optimizer shards")
    per_rank: dict[str, list[dict[str, Any] | None]] = {}
    full = FullOptimizerState()
    group_decays: list[float] = []
    for mp, paths in sorted(files.items()):
        tp_rank = mp % tp  # mp_rank = stage·tp + TP rank
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for path in paths:
            osd = load_torch(path).get("optimizer_state_dict") or {}
            base, mappings = osd.get("base_optimizer_state"), osd.get("param_slice_mappings")
            if not isinstance(base, dict) or mappings is None or int(osd.get("zero_stage", 0)) not in (1, 2):
                raise CheckpointError(f"{path.name}: not a ZeRO-1/2 optimizer shard with parameter mappings")
            for g, mapping in enumerate(mappings):
                group = base["param_groups"][g]
                decay = float(group.get("weight_decay") or 0.0)
                group_decays.append(decay)
                full.group_hparams.setdefault("decay" if decay else "no_decay", {
                    k: v for k, v in group.items() if k != "params"
                })  # fmt: skip
                state = base["state"].get(g) or {}
                for name, frag in mapping.items():
                    key_name = full_param_name(name)
                    slot = pieces.setdefault(key_name, {})
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0:
                            slot.setdefault(key, []).append(value.narrow(0, frag.start, frag.numel))
                        else:
                            scalars.setdefault(key_name, {})[key] = value
        for name, slot in pieces.items():
            shape = shard_shapes(name, tp)
            state: dict[str, Any] = dict(scalars.get(name, {}))
            for key, parts in slot.items():
                flat = torch.cat(parts)
                if flat.numel() != torch.Size(shape).numel():
                    raise CheckpointError(f"ZeRO state {key} of {name}: {flat.numel()} values for shape {shape}")
                state[key] = flat.view(shape).clone()
            ranks = per_rank.setdefault(name, [None] * tp)
            if ranks[tp_rank] is None:  # a tied copy on a later stage carries the same state
                ranks[tp_rank] = state
    if not any(group_decays):  # weight_decay 0: one group with every parameter (see _grouped)
        full.combined = True
        full.group_hparams = {"all": full.group_hparams.get("no_decay", {})}
    merge_per_rank(per_rank, cfg, full)
    return full
