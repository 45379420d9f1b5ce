"""CPU threads per rank: the usable cores divided among the ranks of this node, unless the user chose.

DeepSpeed's launcher leaves ``OMP_NUM_THREADS`` unset (every rank would use every core, oversubscribing the
machine); a fixed 1 leaves every other core idle in a 1-rank run. A user-set ``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron.neox_arguments.errors import ConfigError


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which respects cgroups/taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int, environ: Mapping[str, str], cores: int | None = None) -> tuple[int, str]:
    """``(threads, why)`` for ``local_ranks`` ranks on this node."""
    user = (environ.get("OMP_NUM_THREADS") or "").strip()
    if user:
        if not user.isdigit() or int(user) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={user!r} in the environment: must be a positive integer")
        return int(user), "OMP_NUM_THREADS set in the environment"
    cores = usable_cores() if cores is None else cores
    ranks = max(1, int(local_ranks))
    return max(1, cores // ranks), f"{cores} usable cores / {ranks} local rank{'s' if ranks > 1 else ''}"
