"""CPU threads per rank (cores / local ranks unless OMP_NUM_THREADS is set) and the MFU peak with its source."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.launcher.config import LauncherConfig
from megatron.launcher.launch import plan_launch
from megatron.launcher.threads import threads_per_rank, usable_cores
from megatron.logging.flops import FlopsConfig, throughput_metrics
from megatron.logging.peak_flops import calibrate_gemm_tflops, flops_config_with_peak, gpu_table_peak, resolve_peak
from megatron.neox_arguments import LaunchEnv, NeoXArgs, neox_namespace
from megatron.neox_arguments.errors import ConfigError
from tests.unit.test_launcher import TINY


def test_threads_divide_the_cores_among_local_ranks():
    assert threads_per_rank(1, {}, cores=16) == (16, "16 usable cores / 1 local rank")
    assert threads_per_rank(4, {}, cores=16)[0] == 4
    assert threads_per_rank(3, {}, cores=2)[0] == 1  # never 0
    assert threads_per_rank(2, {"OMP_NUM_THREADS": "3"}, cores=16) == (3, "OMP_NUM_THREADS set in the environment")
    assert threads_per_rank(1, {"OMP_NUM_THREADS": ""}, cores=8)[0] == 8  # empty = unset
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='two'"):
        threads_per_rank(1, {"OMP_NUM_THREADS": "two"})


def test_launch_plan_sets_and_reports_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = NeoXArgs({**TINY, "num_gpus": 1}, env=LaunchEnv(on_cpu=True))
    plan = plan_launch(LauncherConfig.from_neox_args(args), str(tmp_path), on_cpu=True)
    expected = usable_cores()
    assert plan.env["OMP_NUM_THREADS"] == str(expected)
    assert plan.threads.startswith(f"CPU threads per rank: {expected} ({expected} usable cores / 1 local rank")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    plan = plan_launch(LauncherConfig.from_neox_args(args), str(tmp_path), on_cpu=True)
    assert plan.env["OMP_NUM_THREADS"] == "5" and "set in the environment" in plan.threads


def test_peak_sources():
    assert resolve_peak(123.0, torch.float32, on_cpu=True) == (123.0, "peak_theoretical_tflops from the config")
    peak, source = resolve_peak(None, torch.float32, on_cpu=True)
    assert peak is not None and 0 < peak < 1000 and "GEMM calibration on CPU" in source and "float32" in source
    assert gpu_table_peak("NVIDIA H100 80GB HBM3") == 989.0 and gpu_table_peak("NVIDIA A100-SXM4-40GB") == 312.0
    assert gpu_table_peak("NVIDIA A10") == 125.0 and gpu_table_peak("Some NPU") is None
    assert calibrate_gemm_tflops(torch.float32, seconds=0.0, size=64) > 0


def test_cpu_calibration_runs_once_per_process_dtype_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run in the same process (several runs on the same ranks, GPT-NeoX's Python API) reuses the first
    measurement; another dtype or thread count is measured anew."""
    from megatron.logging import peak_flops

    calls: list[torch.dtype] = []

    def counted(dtype: torch.dtype = torch.float32, seconds: float = 0.25, size: int | None = None) -> float:
        calls.append(dtype)
        return calibrate_gemm_tflops(dtype, seconds=0.0, size=64)

    monkeypatch.setattr(peak_flops, "calibrate_gemm_tflops", counted)
    monkeypatch.setattr(peak_flops, "_CALIBRATED", {})
    first = resolve_peak(None, torch.float32, on_cpu=True)
    assert resolve_peak(None, torch.float32, on_cpu=True) == first and calls == [torch.float32]
    assert resolve_peak(None, torch.float64, on_cpu=True)[0] and calls == [torch.float32, torch.float64]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        resolve_peak(None, torch.float32, on_cpu=True)
    finally:
        torch.set_num_threads(threads)
    assert calls == [torch.float32, torch.float64, torch.float32]


def test_flops_config_with_peak_logs_once_and_feeds_mfu(caplog):
    args = neox_namespace(train_batch_size=8, seq_length=256, num_layers=6, hidden_size=128, padded_vocab_size=50304,
                          checkpoint_activations=False, peak_theoretical_tflops=None)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="megatron.train"):
        cfg = flops_config_with_peak(FlopsConfig.from_neox_args(args), torch.float32, rank=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MFU:")]
    assert len(lines) == 1 and "24·K·B·s·l·h²" in lines[0] and "GEMM calibration on CPU" in lines[0]
    assert cfg.peak_theoretical_tflops and cfg.peak_theoretical_tflops > 0
    metrics = throughput_metrics(cfg, iteration_time=2.0, world_size=1)
    assert metrics["runtime/model_flops_utilization"] > 0
    args.peak_theoretical_tflops = 2.0
    caplog.clear()
    assert (
        flops_config_with_peak(FlopsConfig.from_neox_args(args), torch.float32, rank=1).peak_theoretical_tflops == 2.0
    )
    assert not [r for r in caplog.records if r.getMessage().startswith("MFU:")]  # rank 0 only
    assert isinstance(FlopsConfig.from_neox_args(args), FlopsConfig)


def test_gemm_calibration_leaves_the_global_rng_alone() -> None:
    """The MFU peak calibration runs after a checkpoint's RNG state is restored: drawing from the global generator
    there changed every later dropout mask and broke bit-exact resume."""
    import torch

    from megatron.logging.peak_flops import calibrate_gemm_tflops

    before = torch.get_rng_state()
    assert calibrate_gemm_tflops(seconds=0.0, size=64) > 0
    assert torch.equal(torch.get_rng_state(), before)
