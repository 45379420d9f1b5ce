"""Batch sampling: each data-parallel rank takes its contiguous slice of every global batch (GPT-NeoX layout)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from megatron.errors import DataError


class DistributedBatchSampler:
    """Sequential global batches of ``micro_batch_size * dp_size`` indices (last partial batch dropped); DP rank
    ``r`` gets ``[r * micro, (r + 1) * micro)`` of each.

    Resume: the first pass starts at global batch ``start_iter`` (set from consumed samples); every later pass
    (epoch) starts at 0, so iterating the loader again restarts the data without caching any batch.
    """

    def __init__(
        self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, start_iter: int = 0
    ) -> None:
        if micro_batch_size <= 0 or dp_size <= 0:
            raise DataError(f"micro_batch_size and dp_size must be positive, got {micro_batch_size}, {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.global_batch_size = micro_batch_size * dp_size
        self.start_iter = start_iter

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        num_batches = len(self)
        start = self.start_iter % num_batches if num_batches else 0
        self.start_iter = 0  # only the first pass resumes mid-epoch
        lo = self.dp_rank * self.micro_batch_size
        for b in range(start, num_batches):
            base = b * self.global_batch_size + lo
            yield list(range(base, base + self.micro_batch_size))


def iterate_forever(loader: Iterable[Any]) -> Iterator[Any]:
    """Yield batches epoch after epoch by restarting the loader (unlike ``itertools.cycle``, keeps nothing)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError("the data loader is empty: the dataset has fewer samples than one global batch")
