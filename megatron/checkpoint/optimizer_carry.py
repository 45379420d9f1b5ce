"""Carry optimizer state into a run whose data-parallel size, ZeRO stage or optimizer kind differs from the
checkpoint's.

DeepSpeed loads ZeRO optimizer shards only into the DP size and optimizer kind that wrote them, and a ZeRO-1/2/3 or
bf16 engine cannot read the ZeRO-0 form that resharding writes. Here the checkpoint's state is gathered per
parameter (ZeRO-0 torch state, ZeRO-1/2/3 or bf16-optimizer shards,
:func:`megatron.checkpoint.reshard.gather_full_optimizer_state`), split for this rank's TP shard, and written into
the running optimizer: for ZeRO-1/2, ZeRO-3 and the bf16 optimizer into this DP rank's flat fp32 partitions, for
ZeRO-0 as a torch state dict. Other optimizer wrappers (DeepSpeed's ZeRO-0 fp16/bf16 optimizer) are refused with a
pointer to ``no_load_optim``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatron import mpu
from megatron.checkpoint.layout import CheckpointError, detect_layout
from megatron.checkpoint.optimizer_state import FullOptimizerState, is_torch_optimizer_state, scatter_optimizer_state
from megatron.checkpoint.reader import load_torch
from megatron.checkpoint.rules import split_tensor
from megatron.checkpoint.zero_state import ZERO_OPTIM_RE, full_param_name
from megatron.engine_protocol import Engine

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


def _flat_groups(opt: Any) -> tuple[list[torch.Tensor], list[list[torch.nn.Parameter]]] | None:
    """(the fp32 flat partitions the torch optimizer steps, the model parameters of each) of a DeepSpeed optimizer
    this module can write: ZeRO-1/2, ZeRO-3 or the bf16 optimizer; None for any other."""
    if hasattr(opt, "fp32_partitioned_groups_flat") and hasattr(opt, "fp16_groups"):  # ZeRO-3
        return opt.fp32_partitioned_groups_flat, opt.fp16_groups
    if hasattr(opt, "fp32_groups_flat_partition") and hasattr(opt, "bf16_groups"):  # BF16_Optimizer
        return opt.fp32_groups_flat_partition, opt.bf16_groups
    if hasattr(opt, "single_partition_of_fp32_groups") and hasattr(opt, "bit16_groups"):  # ZeRO-1/2
        return opt.single_partition_of_fp32_groups, opt.bit16_groups
    return None


def _zero3_piece(opt: Any, lp: Any, group: int, value: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(offset in the flat partition of sub-group ``group``, this DP rank's piece of ``value``) for a ZeRO-3
    parameter: DeepSpeed cuts it into ``dp`` pieces of ``ceil(numel / dp)``, the last one zero-padded."""
    at_group, offset, size = opt.grad_position[opt.get_param_id(lp)]
    dp, rank = mpu.group_size(opt.dp_process_group), mpu.group_rank(opt.dp_process_group)
    if at_group != group or size * dp < value.numel():
        raise CheckpointError(f"unexpected ZeRO-3 partition of a parameter of {value.numel()} values ({size} x {dp})")
    flat = torch.nn.functional.pad(value.reshape(-1), (0, size * dp - value.numel()))
    return offset, flat.narrow(0, rank * size, size)


def _into_partitions(engine: Engine, full: FullOptimizerState, cfg: Any, tp: int, tp_rank: int) -> None:
    """Write this rank's part of ``full`` into the flat fp32 partitions of a ZeRO-1/2/3 or bf16 optimizer.

    DeepSpeed creates Adam's state lazily at the first step, so the state of every partition is built here:
    element-wise buffers from each parameter's fragment (ZeRO-1/2, bf16: DeepSpeed's fragment map
    ``param._hp_mapping``; ZeRO-3: the parameter's piece at its offset), scalars (``step``) as saved."""
    opt = engine.optimizer
    groups = _flat_groups(opt)
    assert groups is not None
    zero3 = hasattr(opt, "fp32_partitioned_groups_flat")
    names = {p: full_param_name(n) for n, p in engine.module.named_parameters()}
    for i, (hp, lps) in enumerate(zip(*groups)):
        buffers: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for lp in lps:
            mapping = None if zero3 else getattr(lp, "_hp_mapping", None)
            if not zero3 and mapping is None:  # no fragment of this parameter in this DP rank's partition
                continue
            numel = int(getattr(lp, "ds_numel")) if zero3 else lp.numel()  # noqa: B009 - set by DeepSpeed ZeRO-3
            for key, value in _split(full, names[lp], cfg, tp, tp_rank).items():
                if not (torch.is_tensor(value) and value.dim() > 0):
                    scalars[key] = value
                    continue
                if value.numel() != numel:
                    raise CheckpointError(f"optimizer state {key} of {names[lp]}: {tuple(value.shape)} for {numel}")
                buffer = buffers.setdefault(key, torch.zeros_like(hp))
                if zero3:
                    offset, piece = _zero3_piece(opt, lp, i, value.detach())
                    buffer.narrow(0, offset, piece.numel()).copy_(piece.to(hp.dtype))
                    continue
                assert mapping is not None  # not zero3: skipped above when None
                lp_at, hp_at = mapping.lp_fragment_address, mapping.hp_fragment_address
                piece = value.detach().reshape(-1).narrow(0, lp_at.start, lp_at.numel)
                buffer.narrow(0, hp_at.start, hp_at.numel).copy_(piece.to(hp.dtype))
        opt.optimizer.state[hp] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}, **buffers}


def carry_optimizer_state(
    engine: Engine, full: FullOptimizerState, cfg: Any, tp: int, tp_rank: int, pp: int, stage: int
) -> None:
    """Write ``full`` (per full-layout parameter) into ``engine``'s optimizer for this rank."""
    opt = engine.optimizer
    if _flat_groups(opt) is not None:
        _into_partitions(engine, full, cfg, tp, tp_rank)
    elif isinstance(opt, torch.optim.Optimizer):
        opt.load_state_dict(scatter_optimizer_state(full, cfg, tp, pp)(stage, tp_rank))
    else:
        raise CheckpointError(f"optimizer state cannot be carried into {type(opt).__name__} yet")


def _mp_rank_optimizer_kind(directory: Path) -> str:
    """``"torch"`` (a torch optimizer state dict), ``"wrapped"`` (a DeepSpeed wrapper's, e.g. the fp16/bf16
    optimizer of ZeRO-0) or ``"none"``: the optimizer state in the ``mp_rank`` files."""
    files = sorted(directory.glob("mp_rank_*_model_states.pt"))
    opt = load_torch(files[0]).get("optimizer") if files else None
    return "none" if opt is None else "torch" if is_torch_optimizer_state(opt) else "wrapped"


NO_LOAD_OPTIM_HINT = (
    "set no_load_optim: true to resume with fresh optimizer state (weights and iteration are kept; the LR schedule "
    "restarts, as in GPT-NeoX), "
    "or resume at the layout that wrote it"
)


def _source_kind(directory: Path) -> tuple[str, int | None]:
    """(``"zero3"``, ``"bf16"``, ``"zero12"``, ``"torch"`` or ``"wrapped"``, the DP size of its shards) of a
    checkpoint's optimizer state; ``("none", None)`` when it holds none (a converted HF model, a weights-only copy)."""
    zero3 = detect_layout(directory).zero3_files
    if zero3:
        return "zero3", sum(p.name.endswith("_optim_states.pt") for p in next(iter(zero3.values())))
    src_dp, bf16 = zero_shards(directory)
    if src_dp is not None:
        return ("bf16" if bf16 else "zero12"), src_dp
    return _mp_rank_optimizer_kind(directory), None


def _target_kind(engine: Engine) -> str:
    opt = getattr(engine, "optimizer", None)
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return "zero3"
    if hasattr(opt, "fp32_groups_flat_partition"):
        return "bf16"
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return "zero12"
    return "torch" if isinstance(opt, torch.optim.Optimizer) else type(opt).__name__


def load_mode(engine: Engine, directory: Path, *, weights_only_copy: bool) -> str:
    """How the optimizer state of ``directory`` reaches ``engine``: ``"native"`` (DeepSpeed loads it, or there is
    none) or ``"carry"`` (:func:`carry_optimizer_state`); a ``CheckpointError`` when it cannot be carried."""
    shown = directory.parent.parent if ".resharded" in str(directory) else directory
    if weights_only_copy:
        raise CheckpointError(
            f"the optimizer state of {shown} could not be gathered per parameter for this layout (e.g. DeepSpeed's "
            f"ZeRO-0 fp16/bf16 optimizer state; the warning logged when the copy was written says why); {NO_LOAD_OPTIM_HINT}"
        )
    dp = int(getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", 1) or 1)
    source, src_dp = _source_kind(directory)
    target = _target_kind(engine)
    carriable = ("zero3", "bf16", "zero12", "torch")
    if target == "zero3" and source != "zero3":
        raise CheckpointError(
            f"{shown} is not in ZeRO-3 form at this layout (a ZeRO-3 engine reads its weights only from ZeRO-3 "
            "shards of its own tensor-parallel size): resume with ZeRO stage 0-2 at this layout (the optimizer state "
            "is carried over), or with ZeRO-3 at the layout that wrote it"
        )
    if source == "none" or (source == target and src_dp in (None, dp)):
        return "native"  # no state (DeepSpeed starts fresh), or the form and DP size DeepSpeed itself reads
    if source == "wrapped" and target not in carriable:
        return "native"  # a ZeRO-0 fp16/bf16 wrapper's state (not per-DP-rank): DeepSpeed reads it
    if source == "wrapped":
        raise CheckpointError(
            f"{shown} holds the optimizer state of DeepSpeed's ZeRO-0 fp16/bf16 optimizer, which cannot be carried "
            f"into this run's {target} optimizer; {NO_LOAD_OPTIM_HINT}"
        )
    if target not in carriable:
        raise CheckpointError(
            f"{shown} holds {source} optimizer state, and carrying optimizer state into DeepSpeed's {target} "
            f"(this run's optimizer) is not supported; {NO_LOAD_OPTIM_HINT}"
        )
    return "carry"
