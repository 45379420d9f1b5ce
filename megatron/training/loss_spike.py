"""Optional loss-spike skip: a step whose loss is far above the recent ones is skipped like a non-finite step.

``loss_spike_skip_window`` (0: off) is the number of recent *applied* steps whose losses form the reference;
``loss_spike_skip_zscore`` is the threshold: a step whose loss exceeds the window's mean by more than that many
standard deviations is a spike. Only finite losses of steps that were applied enter the window (a NaN, an inf or
a skipped spike never poisons it), and nothing is judged until the window is full. The loss judged is the step's
mean over its micro-batches, already averaged over all ranks in the step's one reduction
(:mod:`megatron.training.nonfinite`), so every rank judges the same value and skips the same steps.
"""

from __future__ import annotations

import math
from collections import deque


class LossSpikeDetector:
    """z-score of a step's loss against the last ``window`` applied steps."""

    def __init__(self, window: int, threshold: float) -> None:
        if window < 2 or not threshold > 0:
            raise ValueError(f"loss spike skip needs a window >= 2 and a threshold > 0, got {window}, {threshold}")
        self.threshold = threshold
        self.losses: deque[float] = deque(maxlen=window)

    def zscore(self, loss: float) -> float | None:
        """How many standard deviations ``loss`` lies above the window's mean; None while the window is not full,
        when it has no spread, or when ``loss`` is not finite (the non-finite check owns that case)."""
        if len(self.losses) < (self.losses.maxlen or 0) or not math.isfinite(loss):
            return None
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / (len(self.losses) - 1))
        return (loss - mean) / std if std > 0.0 else None  # a window without spread cannot judge

    def is_spike(self, loss: float) -> bool:
        """True when ``loss`` is a spike (window full, z-score above the threshold)."""
        z = self.zscore(loss)
        return z is not None and z > self.threshold

    def record(self, loss: float) -> None:
        """Add the loss of an applied step (non-finite losses are ignored)."""
        if math.isfinite(loss):
            self.losses.append(loss)
