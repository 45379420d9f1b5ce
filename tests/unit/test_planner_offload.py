"""ZeRO-Offload and ``checkpoint_in_cpu`` in the plan's memory (megatron/planner/memory.py): what moves to host memory,
what stays on the GPU, the warning, and offload blocks that are not blocks."""

from __future__ import annotations

import json

import pytest

import deepy

BASE = ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "4", "--precision", "bfloat16"]


def _plan(capsys: pytest.CaptureFixture[str], zero: dict, *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *BASE, "--zero_optimization", json.dumps(zero), *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _rank(plan: dict) -> dict:
    return plan["memory"]["per_rank"][0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_moves_the_fp32_state_to_the_host(capsys: pytest.CaptureFixture[str], stage: int) -> None:
    on_gpu = _rank(_plan(capsys, {"stage": stage}))
    plan = _plan(capsys, {"stage": stage, "offload_optimizer": {"device": "cpu"}})
    off = _rank(plan)
    assert off["master_weights"] == off["optimizer_states"] == 0
    assert off["parameters"] == on_gpu["parameters"] and off["activations"] == on_gpu["activations"]
    moved = on_gpu["master_weights"] + on_gpu["optimizer_states"]
    if stage >= 2:  # the sharded gradient partition goes too, as fp32 (16-bit: 2 bytes per parameter on the GPU)
        assert off["gradients"] == 0 and off["host_bytes"] == moved + 2 * on_gpu["gradients"]
    else:  # ZeRO-1 keeps whole 16-bit gradients on the GPU
        assert off["gradients"] == on_gpu["gradients"] and off["host_bytes"] == moved
    assert off["total"] == on_gpu["total"] - moved - (on_gpu["gradients"] if stage >= 2 else 0)  # GPU bytes only
    warning = next(w for w in plan["warnings"] if "offload_optimizer: the offloaded tensors" in w)
    assert f"({off['host_bytes'] / 1e9:.1f} GB per rank" in warning and "CPU optimizer step" in warning
    # Adam (tiny.yml's) under ZeRO-Offload: the launch would stop at start, and the plan says so
    assert any("with optimizer.type 'adam': a launch stops at start unless" in w for w in plan["warnings"])
    cpu_adam = json.dumps({"type": "cpu_adam", "params": {"lr": 1e-3}})
    quiet = _plan(capsys, {"stage": stage, "offload_optimizer": {"device": "cpu"}}, "--optimizer", cpu_adam)
    assert not any("a launch stops at start" in w for w in quiet["warnings"])


def test_offload_param_moves_the_weight_shard_and_device_none_moves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    plain = _rank(_plan(capsys, {"stage": 3}))
    none = _plan(capsys, {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}})
    assert _rank(none) == plain and not any("host memory" in w for w in none["warnings"])  # DeepSpeed's default
    both = _rank(
        _plan(capsys, {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}})
    )
    optimizer_only = _rank(_plan(capsys, {"stage": 3, "offload_optimizer": {"device": "cpu"}}))
    shard = optimizer_only["parameters"] - both["parameters"]
    assert shard > 0 and both["host_bytes"] == optimizer_only["host_bytes"] + shard
    # What stays: the small tensors every rank keeps whole (stage3_param_persistence_threshold)
    assert 0 < both["parameters"] < plain["parameters"]


def test_checkpoint_in_cpu_keeps_the_checkpoints_on_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint_activations", "true", "--pipe_parallel_size", "2", "--gradient_accumulation_steps", "4"]
    gpu = _plan(capsys, {"stage": 1}, *argv)
    cpu = _plan(capsys, {"stage": 1}, *argv, "--checkpoint_in_cpu", "true")
    for before, after in zip(gpu["memory"]["per_rank"], cpu["memory"]["per_rank"], strict=True):
        per_mb = before["activations_per_micro_batch"]
        kept = before["micro_batches_in_flight"] * per_mb["checkpointing_kept"]
        assert after["host_bytes"] == kept > 0
        assert (
            after["activations"]
            == before["activations"] - kept
            == per_mb["checkpointing"] - per_mb["checkpointing_kept"]
        )
    assert any(w.startswith("checkpoint_in_cpu: the offloaded tensors") for w in cpu["warnings"])


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_an_offload_setting_that_is_not_a_block_is_refused(capsys: pytest.CaptureFixture[str], block: str) -> None:
    zero = json.dumps({"stage": 3, block: True})
    assert deepy.main(["--plan", "train.py", *BASE, "--zero_optimization", zero]) == 2
    out, err = capsys.readouterr()
    assert f"zero_optimization.{block}: True is not a block of settings; write e.g. {{device: cpu}}" in err
    assert "Traceback" not in err and out == ""
