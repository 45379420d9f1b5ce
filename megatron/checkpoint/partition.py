"""DeepSpeed's balanced pipeline partition, row-vectorised: the same boundaries, ~100x faster.

DeepSpeed's ``PipelineModule`` splits the layer specs with ``deepspeed.runtime.utils.partition_balanced``: a dynamic
programme over (first ``i`` items, ``j`` parts) that, for every split point ``k < i``, takes the part sums' max and
min so far and keeps the ``k`` of least ``max - min`` (the last such ``k`` on ties, its test is ``>=``). It runs
``O(n² · parts)`` scalar numpy operations in Python: 0.5 s for a 128-layer model in 64 stages, which the planner
paid once per stage and per candidate layout. Row ``i`` of the tables depends only on rows ``k < i``, so each row
is computed here with array operations over all ``(k, j)`` at once, by the same float64 arithmetic in the same
order per element: the boundaries are identical (``tests/unit/test_stage_partition.py`` compares both on random
and real weight lists).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from deepspeed.runtime.utils import partition_uniform


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of ``weights`` (non-negative, finite) exactly as DeepSpeed 0.19.8's
    ``partition_balanced`` computes them."""
    n, m = len(weights), num_parts
    if n <= m:
        return [int(x) for x in partition_uniform(n, m)]
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    dp_max[0, 0] = 0.0  # DeepSpeed leaves dp_min[0, 0] at inf
    for i in range(1, n + 1):
        top = min(i, m)  # parts j = 1 .. top; column j reads column j - 1 of rows k = 0 .. i - 1
        last = (prefix[i] - prefix[:i])[:, None]  # the sum of items k .. i - 1, the new part
        max_sum = np.maximum(dp_max[:i, :top], last)
        min_sum = np.minimum(dp_min[:i, :top], last)
        cost = max_sum - min_sum
        best = i - 1 - np.argmin(cost[::-1], axis=0)  # the last k of least cost (DeepSpeed's ``>=``)
        cols = np.arange(top)
        dp_max[i, 1 : top + 1] = max_sum[best, cols]
        dp_min[i, 1 : top + 1] = min_sum[best, cols]
        position[i, 1 : top + 1] = best
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return parts
