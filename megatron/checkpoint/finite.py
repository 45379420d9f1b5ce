"""Loaded weights must be finite: a checkpoint holding NaN/inf (saved after a divergence, or damaged with its
manifest rewritten) is refused with one line naming the file and the tensor, instead of training or generating from
garbage. One fp32 sum per floating tensor while loading (measured in docs/reliability.md: about a tenth of reading
the weights from the page cache, less from disk)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

SKIPPED = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")  # buffers GPT-NeoX saves, not weights
ADVICE = "the checkpoint is damaged or was saved after the run diverged; load an earlier one (iteration: N)"


def nonfinite_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int] | None:
    """``(name, non-finite count, numel)`` of the first floating tensor holding NaN/inf, else None."""
    for name, tensor in named:
        if not torch.is_tensor(tensor) or not tensor.is_floating_point() or name.endswith(SKIPPED):
            continue
        # NaN and inf survive a sum (a vectorised reduction, ~10x cheaper than isfinite().all()); only a sum that
        # is not finite (also a finite overflow, > 3e38 in fp32) pays for the exact elementwise test
        if not bool(torch.sum(tensor, dtype=torch.float32).isfinite()):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return name, bad, tensor.numel()
    return None


def nonfinite_message(where: str | Path, found: tuple[str, int, int]) -> str:
    """One line: which file, which tensor, how much of it, and what to do."""
    name, bad, numel = found
    return f"{where}: tensor {name} holds {bad} NaN/inf value(s) of {numel}; {ADVICE}"
