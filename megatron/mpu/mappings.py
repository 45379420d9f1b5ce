"""Autograd-aware communication over the tensor-parallel group (all identities at TP size 1).

| function | forward | backward |
|---|---|---|
| copy_to_model_parallel_region | identity | all-reduce |
| reduce_from_model_parallel_region | all-reduce | identity |
| scatter_to_model_parallel_region | keep own slice of the last dim | all-gather last dim |
| gather_from_model_parallel_region | all-gather last dim | keep own slice |
| scatter_to_sequence_parallel_region | keep own slice of seq_dim | all-gather seq_dim |
| gather_from_sequence_parallel_region | all-gather seq_dim | reduce-scatter seq_dim (or slice) |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter seq_dim | all-gather seq_dim |

Reductions of fp16/bf16 tensors run in fp32 when ``set_fp32_allreduce(True)``; gathers are exact anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (
    get_fp32_allreduce,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
)
from megatron.mpu.utils import divide

_HALF = (torch.float16, torch.bfloat16)


def _reduce_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if get_fp32_allreduce() and x.dtype in _HALF else x.dtype


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group into a new tensor."""
    if get_model_parallel_world_size() == 1:
        return x
    out = x.to(_reduce_dtype(x), copy=True).contiguous()
    dist.all_reduce(out, group=get_model_parallel_group())
    return out.to(x.dtype)


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``."""
    world = get_model_parallel_world_size()
    if world == 1:
        return x
    size = divide(x.size(dim), world)
    return x.narrow(dim, get_model_parallel_rank() * size, size).contiguous()


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    world = get_model_parallel_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=get_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``x`` over the TP group and keep this rank's slice along ``dim``."""
    world = get_model_parallel_world_size()
    if world == 1:
        return x
    divide(x.size(dim), world)
    moved = x.movedim(dim, 0).to(_reduce_dtype(x)).contiguous()  # [d, ...]
    out = torch.empty((moved.size(0) // world, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    dist.reduce_scatter_tensor(out, moved, group=get_model_parallel_group())
    return out.movedim(0, dim).to(x.dtype).contiguous()


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"seq_dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _all_reduce(grad)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _split(x, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad, grad.dim() - 1)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _gather(x, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _split(grad, grad.dim() - 1)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _split(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad, ctx.dim), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, tensor_parallel_output_grad: bool) -> torch.Tensor:
        ctx.dim, ctx.tp_grad = dim, tensor_parallel_output_grad
        return _gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Gradients coming from a TP region (e.g. a column-parallel matmul) are partial sums: reduce-scatter.
        if ctx.tp_grad:
            return _reduce_scatter(grad, ctx.dim), None, None
        return _split(grad, ctx.dim), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad, ctx.dim), None


def copy_to_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over TP backward (input of a TP region)."""
    if get_model_parallel_world_size() == 1:
        return x
    return _CopyToModelParallelRegion.apply(x)


def reduce_from_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over TP forward; identity backward (output of a TP region)."""
    if get_model_parallel_world_size() == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x)


def scatter_to_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather backward."""
    if get_model_parallel_world_size() == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x)


def gather_from_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather the last dim forward; keep this rank's slice backward."""
    if get_model_parallel_world_size() == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """Keep this rank's slice of ``seq_dim`` forward; all-gather backward (enter a sequence-parallel region)."""
    if get_model_parallel_world_size() == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, _dim(x, seq_dim))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, seq_dim: int = 0, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather ``seq_dim`` forward; reduce-scatter backward (or a plain slice when the consumer's gradient is
    already complete on every rank, ``tensor_parallel_output_grad=False``)."""
    if get_model_parallel_world_size() == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, _dim(x, seq_dim), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along ``seq_dim`` forward; all-gather backward (leave a TP region into SP)."""
    if get_model_parallel_world_size() == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, _dim(x, seq_dim))
