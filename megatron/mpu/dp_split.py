"""Row slices of a batch per data-parallel rank and the all-gather of their results (lm-eval requests, precompute
documents): each data-parallel replica computes its rows, every rank gets all the results in row order."""

from __future__ import annotations

from typing import Any

from megatron.mpu.collectives import all_gather_objects, group_rank, group_size


class DataParallelSplit:
    """Row slices of a batch per data-parallel rank and the all-gather of their results (no-op at dp=1)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.active = group_size(group) > 1
        self.rank = group_rank(group) if self.active else 0
        self.size = group_size(group) if self.active else 1

    def my_rows(self, n: int) -> range:
        """The contiguous rows ``[start, stop)`` of an ``n``-row batch this rank computes."""
        per = -(-n // self.size)
        return range(min(self.rank * per, n), min((self.rank + 1) * per, n))

    def gather(self, mine: list[Any]) -> list[Any]:
        """Concatenate every rank's results in rank order."""
        if not self.active:
            return mine
        parts = all_gather_objects(mine, group=self.group)
        return [x for part in parts for x in part]
