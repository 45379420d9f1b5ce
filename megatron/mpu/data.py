"""Broadcast a batch from the first rank of each tensor-parallel group to the other TP ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (
    comm_device,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
)

_MAX_DIMS = 8


def _check(keys: list[str], data: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if data is None:
        raise ValueError("broadcast_data: the first rank of the tensor-parallel group must provide the data")
    for key in keys:
        if key not in data:
            raise ValueError(f"broadcast_data: key {key!r} missing from the batch (has {sorted(data)})")
        tensor = data[key]
        if tensor.dtype != dtype:
            raise ValueError(f"broadcast_data: {key!r} has dtype {tensor.dtype}, expected {dtype}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"broadcast_data: {key!r} has {tensor.dim()} dims, at most {_MAX_DIMS} supported")
    return data


def broadcast_data(
    keys: list[str], data: dict[str, torch.Tensor] | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every TP rank, taken from ``data`` on TP rank 0 (``data`` is ignored and
    may be None elsewhere). All tensors must have ``dtype``. Sizes go first, then one flattened payload."""
    if get_model_parallel_world_size() == 1:
        checked = _check(keys, data, dtype)
        return {key: checked[key] for key in keys}
    device = comm_device()
    group, src = get_model_parallel_group(), get_model_parallel_src_rank()
    sizes = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.long, device=device)  # [ndim, d0, d1, ...]
    if get_model_parallel_rank() == 0:
        checked = _check(keys, data, dtype)
        for i, key in enumerate(keys):
            shape = checked[key].shape
            sizes[i, 0] = len(shape)
            sizes[i, 1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.long)
    dist.broadcast(sizes, src, group=group)
    shapes = [tuple(int(d) for d in row[1 : 1 + int(row[0])]) for row in sizes.cpu()]
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    if get_model_parallel_rank() == 0:
        flat = torch.cat([checked[key].reshape(-1) for key in keys]).to(device)
    else:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
    dist.broadcast(flat, src, group=group)
    return {key: part.view(shape) for key, part, shape in zip(keys, torch.split(flat, numels), shapes)}
