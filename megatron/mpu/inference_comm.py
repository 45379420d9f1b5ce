"""Communication of inference under the training layout: activations between pipeline stages, sampled tokens from
the last stage and the TP source rank (small Python objects from rank 0: :func:`megatron.mpu.broadcast_object`).

Every helper is a no-op (returns its input) where the axis it works on has one rank, so the same inference code
runs on one process and on N ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (
    comm_device,
    get_model_parallel_group,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_pipe_parallel_group,
    get_pipe_parallel_group_ranks,
    get_pipe_parallel_rank,
    get_pipe_parallel_world_size,
)


def is_pipe_first_stage() -> bool:
    """This rank runs the embedding (pipeline stage 0)."""
    return get_pipe_parallel_rank() == 0


def is_pipe_last_stage() -> bool:
    """This rank computes the logits (the last pipeline stage)."""
    return get_pipe_parallel_rank() == get_pipe_parallel_world_size() - 1


def send_to_next_stage(tensor: torch.Tensor) -> None:
    """Send this stage's output activations to the next stage of the pipeline group."""
    ranks = get_pipe_parallel_group_ranks()
    dist.send(tensor.contiguous().to(comm_device()), ranks[get_pipe_parallel_rank() + 1])


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Receive the previous stage's activations (``shape`` and ``dtype`` agreed beforehand)."""
    ranks = get_pipe_parallel_group_ranks()
    buffer = torch.empty(shape, dtype=dtype, device=comm_device())
    dist.recv(buffer, ranks[get_pipe_parallel_rank() - 1])
    return buffer.to(device)


def broadcast_from_last_stage(
    tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``tensor`` of the last stage on every stage of the pipeline group (``tensor`` is None elsewhere)."""
    if get_pipe_parallel_world_size() == 1:
        assert tensor is not None
        return tensor
    if is_pipe_last_stage():
        assert tensor is not None and tuple(tensor.shape) == tuple(shape), None if tensor is None else tensor.shape
        buffer = tensor.to(dtype=dtype, device=comm_device()).contiguous()
    else:
        buffer = torch.empty(shape, dtype=dtype, device=comm_device())
    dist.broadcast(buffer, get_pipe_parallel_group_ranks()[-1], group=get_pipe_parallel_group())
    return buffer.to(device)


def broadcast_from_model_parallel_src(tensor: torch.Tensor) -> torch.Tensor:
    """TP rank 0's ``tensor`` on every rank of the tensor-parallel group (same shape and dtype everywhere)."""
    if get_model_parallel_world_size() == 1:
        return tensor
    buffer = tensor.to(comm_device()).contiguous()
    dist.broadcast(buffer, get_model_parallel_src_rank(), group=get_model_parallel_group())
    return buffer.to(tensor.device)
