"""The DeepSpeed ZeRO-3 runs of the DeepSpeed team's Azure post (2022) in the calibration set, and the rule that
DeepSpeed's per-layer cost belongs to its pipeline engine (docs/planner.md, "The pipeline engine's cost per layer")."""

from __future__ import annotations

import dataclasses
import json

import pytest

import deepy
from megatron.planner.calibrated import PIPELINE_LAYER_OVERHEAD_S
from megatron.planner.published_runs import AZURE, PUBLISHED_RUNS

AZURE_RUNS = [r for r in PUBLISHED_RUNS if r.source == AZURE]


def test_the_rows_are_the_posts_models_and_layouts() -> None:
    """The post's Table 2 shapes give its model names; the layout is its recipe's (ZeRO-3 over every GPU, no TP/PP,
    one micro-batch per step, GPT-2's vocabulary, optimizer and checkpoints on the host)."""
    sizes = {"175B": 175e9, "530B": 530e9, "1T": 1e12, "2T": 2e12}
    assert len(AZURE_RUNS) == 5
    for run in AZURE_RUNS:
        h = run.hidden_size
        params = 12 * run.num_layers * h * h + run.padded_vocab_size * h
        assert params == pytest.approx(sizes[run.name.split()[2]], rel=0.04), run.name
        assert (run.tp, run.pp, run.dp, run.gas, run.zero_stage) == (1, 1, run.gpus, 1, 3)
        assert run.offload_optimizer and run.checkpoint_in_cpu and not run.pipeline_engine
    quoted = {r.name: r.published_tflops for r in AZURE_RUNS}
    assert quoted["Azure ZeRO-3 175B 256"] == 204.49 and quoted["Azure ZeRO-3 2T 1024"] == 157.0


def test_the_per_layer_cost_is_the_pipeline_engines() -> None:
    """Fitted only on runs of DeepSpeed's pipeline engine (GPT-NeoX-20B, MT-NLG, BLOOM). The Azure rows ran DeepSpeed's
    engine without a PipelineModule, one micro-batch per step: 0-11 % low without the cost, and the cost would be
    under 1 % of their minutes-long steps (these rows do not decide the rule either way)."""
    for run in AZURE_RUNS:
        plain = run.predict()
        piped = dataclasses.replace(run, pipeline_engine=True).predict()
        assert plain.engine_overhead_s == 0.0
        assert piped.engine_overhead_s == pytest.approx(PIPELINE_LAYER_OVERHEAD_S * run.num_layers, rel=1e-12)
        assert -0.12 < plain.tflops_per_gpu / run.published_tflops - 1 <= 0.005, run.name
        assert piped.engine_overhead_s < 0.01 * piped.step_s


def _predicted(capsys: pytest.CaptureFixture[str], pipe: int) -> dict[str, float]:  # tiny.yml: 2 layers
    argv = ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "4", "--pipe_parallel_size", str(pipe), "--json"]
    assert deepy.main(["--plan", "train.py", *argv]) == 0
    return dict(json.loads(capsys.readouterr().out)["throughput"]["predicted"])


def test_a_neox_forge_plan_without_a_pipeline_module_has_no_per_layer_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """``pipe_parallel_size: 0`` (no PipelineModule) and ``1`` (a one-stage PipelineModule) are the same layout; only
    the pipeline engine pays the cost per layer and micro-batch."""
    plain, piped = _predicted(capsys, 0), _predicted(capsys, 1)
    assert plain["engine_overhead_s"] == 0.0 and piped["gemm_s"] == plain["gemm_s"]
    layers, gas = 2, 1  # tiny.yml
    assert piped["engine_overhead_s"] == pytest.approx(PIPELINE_LAYER_OVERHEAD_S * layers * gas, rel=1e-12)
    assert piped["step_s"] == pytest.approx(plain["step_s"] + piped["engine_overhead_s"], rel=1e-9)
