"""ETA, memory and summary helpers of ``megatron/logging/run_observer.py`` (no distributed run)."""

from __future__ import annotations

import pytest

from megatron.logging.metrics import format_console_line
from megatron.logging.run_observer import RunObserver, format_duration, memory_scalars, memory_stats, memory_text


def test_format_duration() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90061) == "1 days, 1:01:01"
    assert format_duration(-3) == "0:00:00"


def test_eta_is_the_median_recent_step_time_times_iterations_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megatron.logging.run_observer.gather_memory", lambda: [{"rss_gb": 1.0, "peak_rss_gb": 2.0}])
    obs = RunObserver(train_iters=100, train_batch_size=8, seq_length=16)
    assert obs.eta_seconds(0) == 0.0
    # per-iteration times 1.0 (a slow first interval), 0.2, 0.25 -> median 0.25
    assert obs.interval(10, 10.0, 10)["runtime/eta_seconds"] == pytest.approx(90 * 1.0)
    obs.interval(20, 2.0, 10)
    scalars = obs.interval(30, 2.5, 10)
    assert scalars["runtime/eta_seconds"] == pytest.approx(70 * 0.25)
    for i in range(5):  # the window keeps the last 5 intervals: the slow first one drops out
        obs.interval(40 + 10 * i, 1.0, 10)
    assert obs.eta_seconds(90) == pytest.approx(10 * 0.1)
    assert obs.eta_seconds(100) == 0.0
    assert scalars["memory/rss_gb"] == 1.0 and scalars["memory/rank0/peak_rss_gb"] == 2.0


def test_memory_scalars_take_the_largest_rank_and_list_small_worlds() -> None:
    per_rank = [{"rss_gb": 1.0, "peak_rss_gb": 1.5}, {"rss_gb": 2.0, "peak_rss_gb": 2.5}]
    scalars = memory_scalars(per_rank)
    assert scalars["memory/rss_gb"] == 2.0 and scalars["memory/peak_rss_gb"] == 2.5
    assert scalars["memory/rank1/rss_gb"] == 2.0
    assert memory_text(scalars) == "memory (GB) rss/peak: r0 1.00/1.50 r1 2.00/2.50"
    many = memory_scalars([{"rss_gb": float(r), "peak_rss_gb": float(r)} for r in range(16)])
    assert "memory/rank0/rss_gb" not in many and memory_text(many) == "memory (GB) rss/peak: max 15.00/15.00"
    gpu = memory_scalars([{"rss_gb": 1.0, "peak_rss_gb": 1.0, "allocated_gb": 3.0, "peak_allocated_gb": 4.0}])
    assert memory_text(gpu) == "memory (GB) allocated/peak: r0 3.00/4.00"


def test_memory_stats_of_this_process() -> None:
    stats = memory_stats()
    assert 0.01 < stats["rss_gb"] <= stats["peak_rss_gb"] < 1024


def test_console_line_shows_eta_and_memory() -> None:
    values = {"runtime/eta_seconds": 201.0, **memory_scalars([{"rss_gb": 0.5, "peak_rss_gb": 0.75}])}
    line = format_console_line(10, 100, values, {"lm_loss": 2.0}, {})
    assert "| ETA: 0:03:21 | memory (GB) rss/peak: r0 0.50/0.75 | lm_loss: 2.000000E+00" in line


def test_summary_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megatron.logging.run_observer.gather_memory", lambda: [{"rss_gb": 1.0, "peak_rss_gb": 1.0}])
    obs = RunObserver(train_iters=20, train_batch_size=4, seq_length=8, start_iteration=10, start_time=0.0)
    monkeypatch.setattr("megatron.logging.run_observer.time.monotonic", lambda: 3725.0)
    obs.interval(20, 2.0, 10)
    obs.observe({"runtime/model_flops_utilization": 10.0})
    obs.observe({"runtime/model_flops_utilization": 20.0})
    obs.evaluated("validation", 3.0)
    obs.evaluated("validation", 2.5)
    obs.evaluated("test", 1.0)  # test loss is not validation
    obs.saved("ckpt/global_step20")
    assert obs.summary_line(20) == (
        "run summary | steps: 10 (iterations 10 to 20) | tokens seen: 640 | wall time: 1:02:05 | "
        "mean tokens/sec: 160.0 | mean MFU (%): 15.00 | best validation lm_loss: 2.500000E+00 | "
        "last checkpoint: ckpt/global_step20"
    )
    empty = RunObserver(train_iters=5, train_batch_size=1, seq_length=1)
    assert "mean tokens/sec: n/a | mean MFU (%): n/a | best validation lm_loss: n/a | last checkpoint: none" in (
        empty.summary_line(0)
    )
