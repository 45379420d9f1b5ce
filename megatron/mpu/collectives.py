"""World-level and named-group collectives for code outside ``megatron.mpu`` (training, data, checkpoints, logging).

Code outside this package and ``megatron/distributed.py`` never imports ``torch.distributed``; it calls these
helpers instead (``tests/unit/test_layering.py`` enforces it). Each helper is a thin, numerically neutral wrapper:
the same ``torch.distributed`` call with the same reduction, group and argument order as a direct call.

Every helper also works in a plain process (``torch.distributed`` not initialised): ranks are 0, sizes 1, barriers
and reductions do nothing, and gathers return the caller's own value, so the same code runs on one process and on
N ranks.

``group`` arguments take a process group object (``None``: the default, world-spanning group) or one of the
mpu axis names ``"model"`` (tensor parallel), ``"data"``, ``"pipe"`` or ``"io"``; a name resolves to this rank's
group of that axis (``None`` before :func:`megatron.mpu.initialize_model_parallel`, i.e. the world group).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron.cluster.worker_env import launched_local_rank, launched_rank
from megatron.mpu.initialize import (
    comm_device,
    get_data_parallel_group,
    get_io_parallel_group,
    get_model_parallel_group,
    get_pipe_parallel_group,
)

GroupName = Literal["model", "data", "pipe", "io"]
Group = Any  # a torch.distributed ProcessGroup, None (the world) or a GroupName
ReduceOpName = Literal["sum", "max", "min"]

_GROUP_GETTERS = {
    "model": get_model_parallel_group,
    "data": get_data_parallel_group,
    "pipe": get_pipe_parallel_group,
    "io": get_io_parallel_group,
}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def resolve_group(group: Group = None) -> Any:
    """The process group object for ``group`` (a group object or None passes through; a name is looked up)."""
    if isinstance(group, str):
        if group not in _GROUP_GETTERS:
            raise ValueError(f"unknown process group name {group!r}; valid: {', '.join(_GROUP_GETTERS)}")
        return _GROUP_GETTERS[group]()
    return group


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and its default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's global rank: the process group's once it exists, before that the launcher's ``RANK`` (every
    launcher sets it, :mod:`megatron.cluster.worker_env`), 0 in a plain process."""
    return dist.get_rank() if is_distributed() else launched_rank()


def local_rank() -> int:
    """This process's index among the ranks on its host: the launcher's ``LOCAL_RANK`` (torch.distributed has no
    notion of hosts), 0 in a plain process."""
    return launched_local_rank()


def world_size() -> int:
    """Number of ranks in the world (1 in a plain process)."""
    return dist.get_world_size() if is_distributed() else 1


def group_rank(group: Group = None) -> int:
    """This rank's index inside ``group`` (0 in a plain process)."""
    return dist.get_rank(resolve_group(group)) if is_distributed() else 0


def group_size(group: Group = None) -> int:
    """Number of ranks in ``group`` (1 in a plain process)."""
    return dist.get_world_size(resolve_group(group)) if is_distributed() else 1


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` gets here (no-op in a plain process)."""
    if is_distributed():
        dist.barrier(group=resolve_group(group))


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "sum", group: Group = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` with ``op`` and return it (unchanged in a plain process).

    The tensor must already be on :func:`megatron.mpu.comm_device` for the backend (CPU with gloo).
    """
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; valid: {', '.join(_OPS)}")
    if is_distributed():
        dist.all_reduce(tensor, op=_OPS[op], group=resolve_group(group))
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """:func:`all_reduce` with ``"sum"``."""
    return all_reduce(tensor, "sum", group)


def all_reduce_max(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """:func:`all_reduce` with ``"max"`` (e.g. "any rank raised a flag" for 0/1 flags)."""
    return all_reduce(tensor, "max", group)


def all_gather_tensors(tensor: torch.Tensor, group: Group = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype everywhere) in rank order, on :func:`comm_device`.

    In a plain process: ``[tensor]``.
    """
    if not is_distributed():
        return [tensor]
    process_group = resolve_group(group)
    local = tensor.to(comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(parts, local, group=process_group)
    return parts


def all_gather_objects(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (``[obj]`` in a plain process)."""
    if not is_distributed():
        return [obj]
    process_group = resolve_group(group)
    parts: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(parts, obj, group=process_group)
    return parts


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """A picklable object of global rank ``src`` on every rank (``obj`` is ignored elsewhere)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
