"""Per-spec seeding: every layer spec ``i`` is initialised from ``torch.manual_seed(seed + i)`` inside a forked
RNG, so a seed gives the same weights sequentially or under any pipeline partition, without disturbing the
caller's RNG stream (DeepSpeed's ``seed_layers`` would also re-seed every forward, so it is not used)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU default generator seeded to ``seed``; restore the previous state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
