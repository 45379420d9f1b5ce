"""Every item of megatron/training/deepspeed_adapter.py against the installed DeepSpeed (real engines, one gloo rank):
a DeepSpeed release that changes what an item relies on fails here, not silently in a training run."""

from __future__ import annotations

from typing import Any

import deepspeed
import pytest

from megatron.training.deepspeed_adapter import CHECKED_DEEPSPEED
from tests.distributed import fns_deepspeed_adapter as fns
from tests.harness import run_distributed


def one_rank(fn: Any) -> Any:
    return run_distributed(fn, 1, timeout=300)[0]


def test_the_adapter_was_checked_against_the_installed_deepspeed() -> None:
    assert deepspeed.__version__ == CHECKED_DEEPSPEED, (
        f"DeepSpeed {deepspeed.__version__} is installed, deepspeed_adapter.py was checked against {CHECKED_DEEPSPEED}: "
        "re-read the DeepSpeed code each item names, run tests/unit/test_deepspeed_adapter.py, then raise the version"
    )


def test_reduced_gradients_are_found_for_every_optimizer_wrapper() -> None:
    got = one_rank(fns.reduced_gradients_places)
    assert got["plain"]["optimizer"] == "AdamW" and got["plain"]["count"] == 4
    assert got["zero1"]["optimizer"] == got["zero2"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert got["bf16"]["optimizer"] == "BF16_Optimizer"
    for name in ("zero1", "zero2", "zero3", "bf16"):
        assert got[name]["count"] > 0, f"{name}: no reduced gradients where the adapter looks"
        assert got[name]["sq"] == pytest.approx(got["plain"]["sq"], rel=2e-2), name


def test_fp16_without_zero_leaves_the_loss_scale_to_the_caller() -> None:
    got = one_rank(fns.fp16_loss_scale)
    assert got["optimizer"] in ("FP16_Optimizer", "FP16_UnfusedOptimizer") and got["scale"] == 2.0**12
    assert got["grad_ratio"] == pytest.approx(1.0, rel=2e-2), "DeepSpeed now scales the fp16 ZeRO-0 loss itself"


def test_plain_fp32_clipping_goes_through_the_instance_method() -> None:
    got = one_rank(fns.fp32_clipping_call)
    assert got["engine_clips"] and not got["zero_engine_clips"]
    assert got["calls"] == 1, "DeepSpeed's step no longer calls engine.clip_fp32_gradients() once"
    assert got["untouched"]
    assert got["ds_clipped_norm"] == pytest.approx(1e-3, rel=1e-3)
    assert got["global_grad_norm"] is None  # DeepSpeed drops this norm: the step records its own


def test_a_skip_moves_the_counters_an_applied_step_moves() -> None:
    got = one_rank(fns.skip_bookkeeping)
    applied, skipped = got["applied"], got["skipped"]
    moved_by_step = set(applied["changed"]) - {"_step_applied"}
    assert moved_by_step == {"global_steps", "global_samples", "micro_steps"}, applied["changed"]
    assert set(skipped["changed"]) == moved_by_step | {"skipped_steps"}, skipped["changed"]
    for key in moved_by_step:
        assert applied["changed"][key] == skipped["changed"][key], key
    assert applied["weights_moved"] and applied["lr_moved"]
    assert not skipped["weights_moved"] and not skipped["lr_moved"] and not any(skipped["grads_left"])
    assert not got["next_is_boundary"] and got["then_boundary"] and got["then_applies"]


def test_the_pipeline_schedule_steps_through_the_instance_hook() -> None:
    got = one_rank(fns.pipeline_optimizer_hook)
    assert got["calls"] == 2 and got["applied_moved"] and not got["skipped_moved"]
    assert got["skipped_steps"] == 1 and got["global_steps_advanced"] == 1


def test_the_pipeline_loss_is_complete_at_the_optimizer_step() -> None:
    got = one_rank(fns.pipeline_loss_at_step)
    assert len(got["iterations"]) == 2
    for it in got["iterations"]:
        assert it["forwards_at_step"] == 3, "DeepSpeed's schedule no longer steps after every forward pass"
        assert it["total_is_sum"], "total_loss no longer holds the sum of the micro-batch losses at the step"
        assert it["returned_is_mean"], "train_batch no longer returns total_loss / gas"


def test_the_backward_allreduce_follows_its_flag() -> None:
    got = one_rank(fns.single_rank_allreduce)
    assert got["calls_default"] == 1 and got["switched_off"] and got["calls_skipped"] == 0


def test_fp32_zero3_partitions_are_shared_and_train_alike() -> None:
    got = one_rank(fns.zero3_partitions)
    assert not any(got["ds_same_tensor"]), "DeepSpeed now reuses the fp32 partition itself: drop adapter item 7"
    assert got["shared"] == len(got["same_tensor"]) and all(got["same_tensor"])
    assert got["equal_after_steps"]


def test_fp16_on_cpu_is_allowed_on_the_accelerator_instance_only() -> None:
    got = one_rank(fns.fp16_on_cpu)
    # DeepSpeed's CPU accelerator answers oneDNN's native-fp16 check (None or False without it: the case item 8 is for)
    assert bool(got["before"]) == got["native_fp16"] and bool(got["class_answer"]) == got["native_fp16"]
    assert got["after"] is True and got["singleton"] and got["class_method_kept"]


def test_deepspeed_engines_have_every_member_of_the_engine_protocol() -> None:
    """The step, loop, adapter, checkpoint save / load, post-training objectives and in-training evaluation are typed
    against megatron/engine_protocol.py; DeepSpeed's engines must have what it declares (structural typing: they do
    not subclass it), and each declared method's parameters must be the first ones of DeepSpeed's method."""
    got = one_rank(fns.engine_protocol_members)
    assert {"module", "optimizer", "backward", "step", "_take_model_step"} <= set(got["declared"]["plain"])
    checkpoint = {"save_checkpoint", "load_checkpoint", "_get_ckpt_name", "_get_zero_ckpt_name", "dp_world_size"}
    assert checkpoint | {"device", "seq_dp_world_size"} <= set(got["declared"]["plain"])
    assert {"train_batch", "is_last_stage", "total_loss"} <= set(got["declared"]["pipe"])
    assert got["missing"] == {"plain": [], "pipe": []}, got["missing"]
    assert got["signatures"] == {"plain": [], "pipe": []}, got["signatures"]
