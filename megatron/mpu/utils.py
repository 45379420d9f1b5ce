"""Small helpers shared by the tensor-parallel code: exact division, vocab ranges, sharding of full tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def divide(numerator: int, denominator: int) -> int:
    """Return ``numerator // denominator``; raise ``ValueError`` unless the division is exact."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal chunks along its last dimension (views unless asked)."""
    last = tensor.dim() - 1
    size = divide(tensor.size(last), num_partitions)
    chunks = torch.split(tensor, size, dim=last)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """The vocabulary range ``[first, last)`` owned by one TP rank (rows of the vocab-parallel embedding)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Range of a rank when every rank holds ``per_partition_vocab_size`` rows."""
        del world_size  # the range does not depend on it; kept for Megatron's signature
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        """Range of a rank when the whole vocabulary (``global_vocab_size``, divisible by TP) is split evenly."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def _sub_sizes(total: int, sub_sizes: Sequence[int] | None, stride: int) -> list[int]:
    """Sizes of the sub-matrices that make up a partitioned dimension of length ``total``."""
    if sub_sizes is None:
        return [divide(total, stride)] * stride
    sizes = [int(s) for s in sub_sizes]
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        raise ValueError(f"sub-matrix sizes {sizes} must be positive and add up to {total}")
    return sizes


def shard_tensor(
    full: torch.Tensor,
    dim: int,
    rank: int,
    world_size: int,
    *,
    stride: int = 1,
    sub_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The shard of ``full`` that TP rank ``rank`` of ``world_size`` keeps along ``dim``.

    ``full`` along ``dim`` is the concatenation of sub-matrices (``stride`` equal ones, or the given
    ``sub_sizes``). Each sub-matrix is split into ``world_size`` contiguous parts; the rank keeps part ``rank``
    of every sub-matrix, concatenated in order. With one sub-matrix this is a plain contiguous split.
    """
    sizes = _sub_sizes(full.size(dim), sub_sizes, stride)
    if full.is_meta:  # no values to gather (parameter counting); meta ``cat`` would import torch._dynamo (~1 s)
        shape = list(full.shape)
        shape[dim] = sum(divide(size, world_size) for size in sizes)
        return torch.empty(shape, dtype=full.dtype, device="meta")
    parts = []
    for block in torch.split(full, sizes, dim=dim):
        piece = divide(block.size(dim), world_size)
        parts.append(block.narrow(dim, rank * piece, piece))
    return torch.cat(parts, dim=dim).contiguous()


def merge_shards(
    shards: Sequence[torch.Tensor], dim: int, *, stride: int = 1, sub_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's shard (rank order)."""
    world_size = len(shards)
    total = sum(s.size(dim) for s in shards)
    sizes = _sub_sizes(total, sub_sizes, stride)
    local_sizes = [divide(s, world_size) for s in sizes]
    per_rank = [torch.split(shard, local_sizes, dim=dim) for shard in shards]
    blocks = [torch.cat([per_rank[r][i] for r in range(world_size)], dim=dim) for i in range(len(sizes))]
    return torch.cat(blocks, dim=dim)
