"""ZeRO-Offload and ``checkpoint_in_cpu`` in the plan's memory (megatron/planner/memory.py): what moves to host memory,
what stays on the GPU, the warning, and offload blocks that are not blocks."""

from __future__ import annotations

import json

import pytest

import deepy
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.zero_offload import offload_device, offloaded_blocks
from megatron.parallel_config import ParallelConfig
from megatron.training.optimizer_config import OptimizerConfig

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


def test_the_deprecated_cpu_offload_flags_offload_as_deepspeed_maps_them(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed maps ``cpu_offload: true`` to ``offload_optimizer: {device: cpu}`` and ``cpu_offload_param: true``
    to ``offload_param: {device: cpu}`` (GPT-NeoX's Pythia configs write ``cpu_offload: false``); a block's own
    device wins."""
    assert offloaded_blocks({"stage": 2, "cpu_offload": False}) == ()
    assert offloaded_blocks({"stage": 3, "cpu_offload": True, "cpu_offload_param": True}) == (
        "offload_optimizer",
        "offload_param",
    )
    assert offload_device({"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}, "offload_optimizer") == "nvme"
    flag = _rank(_plan(capsys, {"stage": 2, "cpu_offload": True}))
    block = _rank(_plan(capsys, {"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    assert flag == block and flag["host_bytes"] > 0
    args = NeoXArgs.from_ymls(["configs/cpu/tiny.yml"], {"zero_optimization": {"stage": 2, "cpu_offload": True}})
    cfg = OptimizerConfig.from_neox_args(args, ParallelConfig.from_neox_args(args))
    assert cfg.offload_device == "cpu"  # so the optimizer builder refuses Adam here too (test_optim.py)
