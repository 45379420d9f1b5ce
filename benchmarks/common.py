"""What every benchmark reports: versions, threads, load average before/after, medians, rounds, one JSON line.

Benchmarks run A and B interleaved in one process (round i: A then B) so that load on a shared machine hits both
sides alike; the claim is the median of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
# The shared reference files (tokenizers, corpora) some benchmarks read by default: $NEOX_FORGE_SHARED, else
# shared/ beside the clone. A benchmark given explicit --corpus/--vocab-file paths does not need them.
SHARED_DIR = os.environ.get("NEOX_FORGE_SHARED") or os.path.join(os.path.dirname(REPO), "shared")


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions() -> dict[str, str]:
    """Versions of the libraries both sides run on."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "tokenizers", "numpy"):
        with contextlib.suppress(ImportError):
            out[name] = __import__(name).__version__
    return out


def machine() -> str:
    """A one-line machine description (CPU model and usable cores)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def now() -> float:
    return time.perf_counter()


class Report:
    """Collects one benchmark's facts and prints ``ratio=...`` plus the JSON line (also saved for the docs)."""

    def __init__(self, name: str, command: str, **settings: Any) -> None:
        import torch

        self.data: dict[str, Any] = {
            "benchmark": name,
            "command": command,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "versions": versions(),
            "threads": torch.get_num_threads(),
            "load_before": load_average(),
            **settings,
        }

    def finish(self, ratio: float, ratio_meaning: str, save: bool = False, **results: Any) -> dict[str, Any]:
        """Print ``ratio=<x>`` and the JSON line; write ``benchmarks/results/<name>.json`` when ``save``."""
        self.data.update(results)
        self.data["ratio"] = round(float(ratio), 3)
        self.data["ratio_meaning"] = ratio_meaning
        self.data["load_after"] = load_average()
        print(f"ratio={self.data['ratio']} ({ratio_meaning})")
        line = json.dumps(self.data, sort_keys=True)
        print(line, flush=True)
        if save:
            os.makedirs(RESULTS_DIR, exist_ok=True)
            with open(os.path.join(RESULTS_DIR, f"{self.data['benchmark']}.json"), "w") as f:
                f.write(line + "\n")
        return self.data


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-round ratios (each round ran both sides back to back)."""
    return median([n / d for n, d in zip(numerators, denominators, strict=True) if d > 0])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(target: Any, world: int, *args: Any) -> Any:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` spawned processes; returns what rank 0 puts on
    the queue. Raises when a rank fails or every rank exited without a result."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        while True:
            try:
                res = results.get(timeout=5)
                break
            except queue_mod.Empty:
                if not any(proc.is_alive() for proc in procs):
                    raise RuntimeError(f"ranks exited without a result: {[p.exitcode for p in procs]}") from None
        for proc in procs:
            proc.join(timeout=600)
        if any(proc.exitcode for proc in procs):
            raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return res
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
