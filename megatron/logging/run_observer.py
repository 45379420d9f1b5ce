"""What a person watching a run wants besides the loss: an ETA, every rank's memory, and an end-of-run summary.

``RunObserver.interval()`` is called on every rank at each ``log_interval`` and returns the scalars to log:

* ``runtime/eta_seconds``: the median per-iteration time of the last ``ETA_WINDOW`` log intervals (training steps
  only; evaluation and checkpoint saves are not in it) times the iterations left;
* ``memory/<stat>_gb``: the largest value over ranks, and ``memory/rank<r>/<stat>_gb`` per rank for up to
  ``PER_RANK_LIMIT`` ranks. Stats: ``rss`` and ``peak_rss`` (process resident memory, now and its high-water mark)
  on every device; ``allocated``, ``peak_allocated`` and ``reserved`` (CUDA caching allocator) on GPUs.

``summary_line()`` is the one line printed when training ends: steps, tokens seen, wall time, mean tokens/s and
MFU, best validation loss and the last checkpoint.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections import deque

import psutil
import torch

from megatron import mpu

ETA_WINDOW = 5  # log intervals
PER_RANK_LIMIT = 8  # ranks listed one by one (console and metrics); above it, the maximum only
GB = 1024**3


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` past a day)."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days} days, {text}" if days else text


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


def memory_stats() -> dict[str, float]:
    """This process's memory in GiB: RSS and its peak; the CUDA allocator's figures when a GPU is in use."""
    rss = psutil.Process(os.getpid()).memory_info().rss
    # the kernel's high-water mark and the current RSS are counted separately and can differ by a few pages
    stats = {"rss_gb": rss / GB, "peak_rss_gb": max(rss, peak_rss_bytes()) / GB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["allocated_gb"] = torch.cuda.memory_allocated() / GB
        stats["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        stats["reserved_gb"] = torch.cuda.memory_reserved() / GB
    return stats


def gather_memory() -> list[dict[str, float]]:
    """Every rank's ``memory_stats()`` (a collective: all ranks call it)."""
    local = memory_stats()
    if mpu.world_size() == 1:
        return [local]
    keys = sorted(local)
    parts = mpu.all_gather_tensors(torch.tensor([local[k] for k in keys], dtype=torch.float64))
    return [dict(zip(keys, p.cpu().tolist())) for p in parts]


def memory_scalars(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """``memory/<stat>`` (maximum over ranks) and ``memory/rank<r>/<stat>`` for small worlds."""
    out = {f"memory/{k}": max(r[k] for r in per_rank) for k in per_rank[0]}
    if len(per_rank) <= PER_RANK_LIMIT:
        for rank, stats in enumerate(per_rank):
            out.update({f"memory/rank{rank}/{k}": v for k, v in stats.items()})
    return out


def memory_text(scalars: dict[str, float]) -> str | None:
    """The console part for the ``memory/*`` scalars: ``memory (GB) rss/peak: r0 0.81/0.85 r1 ...``."""
    gpu = "memory/peak_allocated_gb" in scalars
    now, peak = ("allocated_gb", "peak_allocated_gb") if gpu else ("rss_gb", "peak_rss_gb")
    if f"memory/{now}" not in scalars:
        return None
    label = "memory (GB) allocated/peak" if gpu else "memory (GB) rss/peak"
    ranks = []
    rank = 0
    while f"memory/rank{rank}/{now}" in scalars:
        ranks.append(f"r{rank} {scalars[f'memory/rank{rank}/{now}']:.2f}/{scalars[f'memory/rank{rank}/{peak}']:.2f}")
        rank += 1
    if not ranks:
        ranks.append(f"max {scalars[f'memory/{now}']:.2f}/{scalars[f'memory/{peak}']:.2f}")
    return f"{label}: {' '.join(ranks)}"


class RunObserver:
    """ETA and memory at each log interval; the totals for the summary line."""

    def __init__(
        self,
        train_iters: int,
        train_batch_size: int,
        seq_length: int,
        start_iteration: int = 0,
        start_time: float | None = None,
    ) -> None:
        self.train_iters, self.batch, self.seq = train_iters, train_batch_size, seq_length
        self.start_iteration = start_iteration
        self.start_time = time.monotonic() if start_time is None else start_time  # time.monotonic() at the start
        self.step_times: deque[float] = deque(maxlen=ETA_WINDOW)
        self.train_time = 0.0  # seconds in training steps
        self.train_steps = 0
        self.mfu: list[float] = []
        self.best_valid: float | None = None
        self.last_checkpoint: str | None = None

    def interval(self, iteration: int, interval_time: float, interval_iters: int) -> dict[str, float]:
        """Scalars for the log line of ``iteration``; a collective (memory is gathered from every rank)."""
        self.step_times.append(interval_time / max(interval_iters, 1))
        self.train_time += interval_time
        self.train_steps += interval_iters
        scalars = {"runtime/eta_seconds": self.eta_seconds(iteration)}
        scalars.update(memory_scalars(gather_memory()))
        return scalars

    def eta_seconds(self, iteration: int) -> float:
        """Median recent step time times the iterations left (0 before the first interval)."""
        if not self.step_times:
            return 0.0
        return statistics.median(self.step_times) * max(self.train_iters - iteration, 0)

    def observe(self, scalars: dict[str, float]) -> None:
        """Keep the MFU of each logged interval."""
        if "runtime/model_flops_utilization" in scalars:
            self.mfu.append(float(scalars["runtime/model_flops_utilization"]))

    def evaluated(self, prefix: str, loss: float) -> None:
        """Track the best validation loss."""
        if prefix == "validation" and loss == loss and (self.best_valid is None or loss < self.best_valid):
            self.best_valid = loss

    def saved(self, path: str) -> None:
        """Remember the last checkpoint written."""
        self.last_checkpoint = path

    def summary_line(self, iteration: int) -> str:
        """``run summary | steps: ... | tokens seen: ... | wall time: ... | ...``."""
        steps = iteration - self.start_iteration
        tokens_per_sec = self.train_steps * self.batch * self.seq / self.train_time if self.train_time else None
        parts = [
            f"steps: {steps} (iterations {self.start_iteration} to {iteration})",
            f"tokens seen: {iteration * self.batch * self.seq:,}",
            f"wall time: {format_duration(time.monotonic() - self.start_time)}",
            f"mean tokens/sec: {tokens_per_sec:.1f}" if tokens_per_sec else "mean tokens/sec: n/a",
            f"mean MFU (%): {statistics.fmean(self.mfu):.2f}" if self.mfu else "mean MFU (%): n/a",
            f"best validation lm_loss: {self.best_valid:.6E}"
            if self.best_valid is not None
            else "best validation lm_loss: n/a",
            f"last checkpoint: {self.last_checkpoint or 'none'}",
        ]
        return "run summary | " + " | ".join(parts)
