"""``deepy.py --plan --framework``: whose engine the calibrated prediction applies (issue 37)."""

from __future__ import annotations

import json

import pytest

import deepy
from megatron.planner.calibrated import DEFAULT_FRAMEWORK, FRAMEWORKS, Calibration
from megatron.planner.published_runs import PUBLISHED_RUNS

NEOX_20B = ["configs/20B.yml", "--gpus", "96", "--vocab-size", "50277", "--inter-node-GBps", "12.5"]


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *NEOX_20B, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_is_neox_forge_and_other_engines_also_give_neox_forges_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert DEFAULT_FRAMEWORK == "neox-forge" and FRAMEWORKS[DEFAULT_FRAMEWORK] == "deepspeed"
    ours = _plan(capsys)["throughput"]
    assert ours["predicted"]["framework"] == "neox-forge" and "predicted_neox_forge" not in ours
    megatron = _plan(capsys, "--framework", "megatron-lm")["throughput"]
    assert megatron["predicted"]["framework"] == "megatron-lm"
    same = {k: v for k, v in ours["predicted"].items() if k != "framework"}
    assert megatron["predicted_neox_forge"] == same  # neox-forge on the same layout, unchanged
    # Megatron-LM's loop: no DeepSpeed engine factor on compute, scatter/gather pipeline sends (1/TP of the bytes).
    pace = Calibration().deepspeed_engine_efficiency
    assert megatron["predicted"]["gemm_s"] == pytest.approx(ours["predicted"]["gemm_s"] * pace)
    assert megatron["predicted"]["pipe_comm_s"] == pytest.approx(ours["predicted"]["pipe_comm_s"] / 2)
    assert megatron["predicted"]["tflops_per_gpu"] > 1.1 * ours["predicted"]["tflops_per_gpu"]
    table = capsys_table(capsys, "--framework", "megatron-lm")
    assert "(calibrated, megatron-lm's engine)" in table and "neox-forge          " in table


def capsys_table(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert deepy.main(["--plan", "train.py", *NEOX_20B, *argv]) == 0
    return capsys.readouterr().out


def test_gpt_neox_framework_reproduces_the_published_20b_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner on configs/20B.yml with GPT-NeoX's engine and partition predicts what the calibration row does
    (the row counts parameters as 12·h² per layer + embedding, the plan exactly: within 1 %)."""
    row = next(r for r in PUBLISHED_RUNS if r.name == "GPT-NeoX-20B")
    assert row.framework == "gpt-neox" and row.workload().layers_per_stage == 12  # GPT-NeoX's split of 44 over 4
    plan = _plan(capsys, "--framework", "gpt-neox", "--pipe_partition_method", "type:transformer|mlp")
    assert plan["parameters"]["layers_by_stage"] == [11, 12, 11, 10]
    assert plan["throughput"]["predicted"]["tflops_per_gpu"] == pytest.approx(row.predict().tflops_per_gpu, rel=0.01)


def test_every_published_run_names_a_known_framework() -> None:
    assert {r.framework for r in PUBLISHED_RUNS} <= set(FRAMEWORKS) - {DEFAULT_FRAMEWORK}


def test_unknown_framework_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        deepy.main(["--plan", "train.py", *NEOX_20B, "--framework", "fsdp2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--framework: invalid choice: 'fsdp2'" in err and "megatron-lm" in err
