"""Metrics sinks (TensorBoard and offline W&B read back), the FLOPs formula, timers and the console line."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from megatron.logging.flops import FlopsConfig, flops_formula, flops_per_iteration, throughput_metrics
from megatron.logging.metrics import LoggingConfig, Metrics, format_console_line
from megatron.logging.timers import Timers
from megatron.logging.wandb_reader import find_run_files, read_wandb_history
from megatron.neox_arguments import neox_namespace


def _read_tb(path: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(path, size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_flops_formula_by_hand() -> None:
    cfg = FlopsConfig(
        train_batch_size=8, seq_length=128, num_layers=2, hidden_size=64, padded_vocab_size=512, num_attention_heads=4
    )
    expected = 24 * 3 * 8 * 128 * 2 * 64 * 64 * (1 + 128 / (6 * 64) + 512 / (16 * 2 * 64))
    assert flops_per_iteration(cfg) == pytest.approx(expected)
    cfg.peak_theoretical_tflops = 1.0
    m = throughput_metrics(cfg, iteration_time=0.5, world_size=2)
    assert m["runtime/samples_per_sec"] == pytest.approx(16.0)
    assert m["runtime/tokens_per_sec"] == pytest.approx(16.0 * 128)
    assert m["runtime/flops_per_sec_per_gpu"] == pytest.approx(expected / (0.5 * 2))
    assert m["runtime/model_flops_utilization"] == pytest.approx(100 * expected / 1.0 / 1e12)
    cfg.checkpoint_activations = True
    m = throughput_metrics(cfg, iteration_time=0.5, world_size=2)
    assert m["runtime/hardware_flops_utilization"] == pytest.approx(100 * expected * 4 / 3 / 1e12)
    assert m["runtime/model_flops_utilization"] == pytest.approx(100 * expected / 1e12)


def test_rwkv_flops_formula_is_gpt_neox_s() -> None:
    """A model with rwkv layers counts with GPT-NeoX's RWKV formula (megatron/logging.py), for MFU and HFU alike."""
    cfg = FlopsConfig(
        train_batch_size=8,
        seq_length=128,
        num_layers=2,
        hidden_size=64,
        padded_vocab_size=512,
        num_attention_heads=4,
        attention_config=["rwkv", "rwkv"],
    )
    b, s, layers, h, v, a = 8, 128, 2, 64, 512, 4
    expected = b * s * (78 * h * h * layers + 84 * h * layers + 16 * h + 12 * h * v + 18 * h * h * layers / a)
    assert flops_per_iteration(cfg, 3) == pytest.approx(expected)
    assert flops_per_iteration(cfg, 4) == pytest.approx(expected)
    assert "RWKV" in flops_formula(cfg) and "RWKV" not in flops_formula(replace(cfg, attention_config=None))


def test_tensorboard_sink_roundtrip(tmp_path) -> None:
    cfg = LoggingConfig.from_neox_args(neox_namespace(tensorboard_dir=str(tmp_path / "tb"), log_interval=None))
    assert cfg.log_interval == 100
    metrics = Metrics.create(cfg, rank=0, config_text="{}")
    for step in range(1, 6):
        metrics.log({"train/lm_loss": 10.0 / step, "train/learning_rate": 1e-3}, step)
    metrics.close()
    scalars = _read_tb(str(tmp_path / "tb"))
    assert [s for s, _ in scalars["train/lm_loss"]] == [1, 2, 3, 4, 5]
    assert scalars["train/lm_loss"][-1][1] == pytest.approx(2.0)
    assert Metrics.create(cfg, rank=1).sinks == []  # only rank 0 writes


def test_wandb_offline_roundtrip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(use_wandb=True, wandb_project="neox-test", log_dir=str(tmp_path))
    metrics = Metrics.create(cfg, rank=0, run_config={"hidden_size": 64})
    for step in range(1, 4):
        metrics.log({"train/lm_loss": float(step), "runtime/samples_per_sec": 2.5}, step)
    metrics.close()
    (run_file,) = find_run_files(tmp_path)
    rows = read_wandb_history(run_file)
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [r["train/lm_loss"] for r in rows] == [1.0, 2.0, 3.0]
    assert os.path.isdir(tmp_path / "wandb")


def test_timers_and_console_line() -> None:
    timers = Timers()
    timers("forward").start()
    timers("forward").stop()
    with pytest.raises(RuntimeError):
        timers("forward").stop()
    out = timers.breakdown(["forward", "missing"])
    assert list(out) == ["timers/forward"] and out["timers/forward"] >= 0
    assert timers.breakdown(["forward"])["timers/forward"] == 0.0  # reset after reading
    timers("backward").start()
    time.sleep(0.02)
    timers("backward").stop()
    seconds = timers.breakdown(["backward"], normalizer=2, reset=False)  # GPT-NeoX's unit: seconds per iteration
    assert 0.01 <= seconds["timers/backward"] < 5.0
    assert timers.format(seconds) == f"time (ms) | backward: {seconds['timers/backward'] * 1000:.2f}"
    timers.reset(["backward"])
    assert timers.breakdown(["backward"])["timers/backward"] == 0.0
    line = format_console_line(
        10,
        100,
        {"train/learning_rate": 1e-3, "runtime/iteration_time": 0.25, "runtime/flops_per_sec_per_gpu": 2e12},
        {"lm_loss": 3.5},
        {"number of skipped iterations": 0, "number of nan iterations": 1},
    )
    assert "iteration       10/     100" in line
    assert "learning rate: 1.000E-03" in line and "lm_loss: 3.500000E+00" in line
    assert "elapsed time per iteration (ms): 250.0" in line and "2.0000 TFLOP/s" in line
    assert line.endswith("number of nan iterations: 1")


def test_loop_counts_skipped_and_nan_iterations() -> None:
    from megatron.training.loop import MAX_CONSECUTIVE_OVERFLOWS, LoopState, Trainer
    from megatron.training.step import StepResult

    state = LoopState(iteration=0)
    for result in (StepResult(2.0, False), StepResult(float("nan"), False), StepResult(9.0, True)):
        Trainer._count(state, result)
    assert (state.loss_sum, state.loss_count, state.nan_iters, state.skipped_iters) == (2.0, 1, 1, 1)
    with pytest.raises(ValueError, match="consecutive fp16 overflows"):
        for _ in range(MAX_CONSECUTIVE_OVERFLOWS):
            Trainer._count(state, StepResult(1.0, True))
