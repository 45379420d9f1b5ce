"""The peak FLOP/s that MFU divides by, and where it came from.

In order: ``peak_theoretical_tflops`` from the config; on CUDA, a table of known GPUs' dense bf16/fp16 tensor-core
peaks (vendor datasheets); on CPU, a short in-process GEMM calibration (the best sustained ``torch.mm``
throughput of this rank's threads in the training dtype, measured once per process, dtype and thread count) — a
measured ceiling, not a datasheet number, so CPU MFU reads as "fraction of what this machine's GEMM reaches". Logged
once at the start of training.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from megatron.distributed import on_cpu
from megatron.logging.flops import FLOPS_FORMULA, FlopsConfig

logger = logging.getLogger("megatron.train")

# Dense (no sparsity) bf16/fp16 tensor-core peak TFLOP/s per GPU, from the vendors' datasheets.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; PCIe is 756
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A6000": 155.0,
    "A40": 150.0,
    "A10": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "T4": 65.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def gpu_table_peak(name: str) -> float | None:
    """Peak of the longest table entry contained in the device ``name`` (e.g. "NVIDIA H100 80GB HBM3")."""
    hits = [key for key in GPU_PEAK_TFLOPS if key.lower() in name.lower()]
    return GPU_PEAK_TFLOPS[max(hits, key=len)] if hits else None


def calibrate_gemm_tflops(dtype: torch.dtype = torch.float32, seconds: float = 0.25, size: int | None = None) -> float:
    """Best measured TFLOP/s of a square ``torch.mm`` on this process's CPU threads (at least 3 repetitions)."""
    n = size or (512 if dtype == torch.float32 else 256)  # half precision may fall back to a slow gemm
    gen = torch.Generator().manual_seed(0)  # its own generator: the run's RNG streams (dropout, data) stay untouched
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    best, start, reps = float("inf"), time.perf_counter(), 0
    while reps < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
        reps += 1
    return 2.0 * n**3 / max(best, 1e-9) / 1e12


# (dtype, threads) -> the calibrated peak: a process that trains again (GPT-NeoX's Python API, several runs on the
# same ranks) reuses its first measurement instead of spending another 0.25 s of every core on GEMMs
_CALIBRATED: dict[tuple[torch.dtype, int], float] = {}


def resolve_peak(configured: float | None, dtype: torch.dtype, on_cpu: bool) -> tuple[float | None, str]:
    """``(peak TFLOP/s per rank or None, source)``."""
    if configured:
        return float(configured), "peak_theoretical_tflops from the config"
    if on_cpu:
        threads = torch.get_num_threads()
        dt = str(dtype).removeprefix("torch.")
        key = (dtype, threads)
        if key not in _CALIBRATED:
            _CALIBRATED[key] = calibrate_gemm_tflops(dtype)
        peak = _CALIBRATED[key]
        return peak, f"in-process {dt} GEMM calibration on CPU ({threads} thread{'s' if threads > 1 else ''})"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown device"
    gpu_peak = gpu_table_peak(name)
    if gpu_peak is None:
        return None, f"{name} is not in the table of known GPUs: set peak_theoretical_tflops to log MFU"
    return gpu_peak, f"table of known GPUs ({name}: dense bf16/fp16 datasheet peak)"


def flops_config_with_peak(cfg: FlopsConfig, params_dtype: torch.dtype, rank: int = 0) -> FlopsConfig:
    """``cfg`` with the peak resolved (calibrated in ``params_dtype`` on the CPU); logs formula, peak and source
    once (rank 0)."""
    peak, source = resolve_peak(cfg.peak_theoretical_tflops, params_dtype, on_cpu())
    if rank == 0:
        shown = f"{peak:.4g} TFLOP/s per rank" if peak else "unknown (MFU not logged)"
        logger.info("MFU: FLOPs per iteration = %s; peak %s from %s; CPU threads per rank: %d", FLOPS_FORMULA, shown,
                    source, torch.get_num_threads())  # fmt: skip
    return replace(cfg, peak_theoretical_tflops=peak)
