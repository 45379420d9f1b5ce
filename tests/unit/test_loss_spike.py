"""The z-score loss-spike detector: judged only on a full window, NaN-safe, upward spikes only."""

from __future__ import annotations

import math

import pytest

from megatron.training.loss_spike import LossSpikeDetector


def test_spike_needs_a_full_window_and_a_high_zscore() -> None:
    d = LossSpikeDetector(window=4, threshold=3.0)
    for loss in (5.0, 4.9, 5.1):
        assert not d.is_spike(100.0)  # window not full yet: nothing is judged
        d.record(loss)
    d.record(5.0)
    assert d.zscore(5.0) == pytest.approx(0.0, abs=1e-9)
    assert d.is_spike(6.0) and not d.is_spike(5.2) and not d.is_spike(1.0)  # a drop is never a spike
    assert d.zscore(6.0) == pytest.approx((6.0 - 5.0) / math.sqrt(0.02 / 3))


def test_spike_window_is_nan_safe_and_rolls() -> None:
    d = LossSpikeDetector(window=3, threshold=2.0)
    for loss in (2.0, float("nan"), 2.1, float("inf"), 1.9):
        d.record(loss)
    assert list(d.losses) == [2.0, 2.1, 1.9]  # non-finite losses never enter the window
    assert d.zscore(float("nan")) is None and not d.is_spike(float("inf"))
    d.record(3.0)
    assert list(d.losses) == [2.1, 1.9, 3.0]
    flat = LossSpikeDetector(window=2, threshold=1.0)
    flat.record(1.0)
    flat.record(1.0)
    assert flat.zscore(2.0) is None  # no spread: nothing to judge against


@pytest.mark.parametrize(("window", "threshold"), [(1, 3.0), (4, 0.0), (4, float("nan"))])
def test_spike_detector_refuses_bad_settings(window: int, threshold: float) -> None:
    with pytest.raises(ValueError, match="window >= 2"):
        LossSpikeDetector(window, threshold)
