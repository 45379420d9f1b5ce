"""Carry optimizer state into a run whose data-parallel size or ZeRO stage differs from the checkpoint's.

DeepSpeed loads ZeRO-1/2 optimizer shards only into the DP size that wrote them, and a ZeRO-1/2 engine cannot
read the ZeRO-0 form that resharding writes. Here the checkpoint's state is gathered per parameter (ZeRO-0 torch
state or ZeRO-1/2 fp32 shards, :func:`megatron.checkpoint.reshard.gather_full_optimizer_state`), split for this
rank's TP shard, and written into the running optimizer: for ZeRO-1/2 into this DP rank's flat fp32 partition
through DeepSpeed's own fragment map (``param._hp_mapping``), for ZeRO-0 as a torch state dict. ZeRO-3 and the
bf16 optimizer are refused by the caller (their state is not carried yet).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.optimizer_state import FullOptimizerState, scatter_optimizer_state
from megatron.checkpoint.rules import split_tensor
from megatron.checkpoint.zero_state import ZERO_OPTIM_RE, full_param_name

logger = logging.getLogger(__name__)


def zero_shards(directory: Path) -> tuple[int | None, bool]:
    """(the DP size that wrote the ZeRO-1/2 or bf16-optimizer shards of ``directory`` or None, whether bf16)."""
    ranks: dict[int, set[int]] = {}
    bf16 = False
    for path in directory.iterdir():
        m = ZERO_OPTIM_RE.match(path.name)
        if m:
            bf16 |= bool(m.group(1))
            ranks.setdefault(int(m.group(3)), set()).add(int(m.group(2)))
    return (len(next(iter(ranks.values()))) if ranks else None), bf16


def _split(full: FullOptimizerState, name: str, cfg: Any, tp: int, tp_rank: int) -> dict[str, Any]:
    src = full.per_param.get(name)
    if src is None:
        raise CheckpointError(f"the checkpoint has no optimizer state for parameter {name}")
    out = {}
    for key, value in src.items():
        is_tensor = torch.is_tensor(value) and value.dim() > 0
        out[key] = split_tensor(name, value, cfg, tp)[tp_rank] if is_tensor else value
    return out


def _into_zero12(engine: Any, full: FullOptimizerState, cfg: Any, tp: int, tp_rank: int) -> None:
    opt = engine.optimizer
    names = {p: full_param_name(n) for n, p in engine.module.named_parameters()}
    for i, hp in enumerate(opt.single_partition_of_fp32_groups):
        buffers: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for lp in opt.bit16_groups[i]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:  # no fragment of this parameter in this DP rank's partition
                continue
            for key, value in _split(full, names[lp], cfg, tp, tp_rank).items():
                if not (torch.is_tensor(value) and value.dim() > 0):
                    scalars[key] = value
                    continue
                if value.numel() != lp.numel():
                    raise CheckpointError(f"optimizer state {key} of {names[lp]}: {tuple(value.shape)} for {lp.shape}")
                lp_at, hp_at = mapping.lp_fragment_address, mapping.hp_fragment_address
                buffer = buffers.setdefault(key, torch.zeros_like(hp))
                piece = value.detach().reshape(-1).narrow(0, lp_at.start, lp_at.numel)
                buffer.narrow(0, hp_at.start, hp_at.numel).copy_(piece.to(hp.dtype))
        opt.optimizer.state[hp] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}, **buffers}


def carry_optimizer_state(
    engine: Any, full: FullOptimizerState, cfg: Any, tp: int, tp_rank: int, pp: int, stage: int
) -> None:
    """Write ``full`` (per full-layout parameter) into ``engine``'s optimizer for this rank."""
    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups") and hasattr(opt, "bit16_groups"):
        _into_zero12(engine, full, cfg, tp, tp_rank)
    elif isinstance(opt, torch.optim.Optimizer):
        opt.load_state_dict(scatter_optimizer_state(full, cfg, tp, pp)(stage, tp_rank))
    else:
        raise CheckpointError(f"optimizer state cannot be carried into {type(opt).__name__} yet")


def _has_torch_optimizer_state(directory: Path) -> bool:
    from megatron.checkpoint.reader import load_torch

    files = sorted(directory.glob("mp_rank_*_model_states.pt"))
    return bool(files) and load_torch(files[0]).get("optimizer") is not None


NO_LOAD_OPTIM_HINT = (
    "set no_load_optim: true to resume with fresh optimizer state (weights, LR schedule and iteration are kept), "
    "or resume at the layout that wrote it"
)


def load_mode(engine: Any, directory: Path, *, weights_only_copy: bool) -> str:
    """How the optimizer state of ``directory`` reaches ``engine``: ``"native"`` (DeepSpeed loads it) or
    ``"carry"`` (:func:`carry_optimizer_state`); a ``CheckpointError`` when it cannot be carried."""
    from megatron.checkpoint.layout import detect_layout

    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
    dp = int(getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", 1) or 1)
    src_dp, bf16_shards = zero_shards(directory)
    zero3 = detect_layout(directory).zero3_files
    if weights_only_copy:
        raise CheckpointError(
            f"the optimizer state of {directory.parent.parent if '.resharded' in str(directory) else directory} "
            f"(ZeRO-3 or bf16 optimizer) cannot be carried to this layout yet; {NO_LOAD_OPTIM_HINT}"
        )
    if zero3:
        src = sum(p.name.endswith("_optim_states.pt") for p in next(iter(zero3.values())))
        if stage == 3 and src == dp:
            return "native"
        raise CheckpointError(
            f"{directory} holds ZeRO-3 optimizer state for {src} data-parallel ranks; carrying it to ZeRO stage "
            f"{stage} with {dp} data-parallel ranks is not supported yet; {NO_LOAD_OPTIM_HINT}"
        )
    if bf16_shards or (engine.bfloat16_enabled() if hasattr(engine, "bfloat16_enabled") else False):
        if src_dp == dp:
            return "native"
        raise CheckpointError(
            f"{directory}: carrying bf16 optimizer state across a change of data-parallel size or ZeRO stage is not "
            f"supported yet (checkpoint: {src_dp or 'no'} ZeRO shards, run: ZeRO stage {stage} x {dp} ranks); "
            f"{NO_LOAD_OPTIM_HINT}"
        )
    if stage == 3:
        raise CheckpointError(
            f"{directory} was not written by a ZeRO-3 run of {dp} data-parallel ranks; carrying its optimizer state "
            f"into ZeRO-3 is not supported yet; {NO_LOAD_OPTIM_HINT}"
        )
    if stage in (1, 2):
        if src_dp is None and not _has_torch_optimizer_state(directory):
            return "native"  # no optimizer state to carry (e.g. a converted HF model): DeepSpeed starts fresh
        return "native" if src_dp == dp else "carry"
    return "native" if src_dp is None else "carry"
