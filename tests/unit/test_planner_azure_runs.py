"""The DeepSpeed ZeRO-3 runs of the DeepSpeed team's Azure post (2022) in the calibration set, and the rule they
support: DeepSpeed's engine factor belongs to its pipeline engine (docs/planner.md, "Calibration")."""

from __future__ import annotations

import dataclasses
import json

import pytest

import deepy
from megatron.planner.calibrated import DEEPSPEED_ENGINE_EFFICIENCY
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


def test_the_engine_factor_is_the_pipeline_engines() -> None:
    """Fitted only on runs of DeepSpeed's pipeline engine (GPT-NeoX-20B, MT-NLG, BLOOM). The Azure rows ran DeepSpeed's
    engine without a PipelineModule: with the factor they come out 6-24 % low, without it 0-12 % low."""
    for run in AZURE_RUNS:
        plain = run.predict().tflops_per_gpu / run.published_tflops - 1
        factored = dataclasses.replace(run, pipeline_engine=True).predict().tflops_per_gpu / run.published_tflops - 1
        assert -0.12 < plain <= 0.005 and -0.24 < factored < -0.06, run.name
        assert factored < plain


def _gemm_s(capsys: pytest.CaptureFixture[str], pipe: int) -> float:
    argv = ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "4", "--pipe_parallel_size", str(pipe), "--json"]
    assert deepy.main(["--plan", "train.py", *argv]) == 0
    return float(json.loads(capsys.readouterr().out)["throughput"]["predicted"]["gemm_s"])


def test_a_neox_forge_plan_without_a_pipeline_module_runs_at_megatron_pace(capsys: pytest.CaptureFixture[str]) -> None:
    """``pipe_parallel_size: 0`` (no PipelineModule) and ``1`` (a one-stage PipelineModule) are the same layout; only
    the pipeline engine pays the factor."""
    assert _gemm_s(capsys, 1) == pytest.approx(_gemm_s(capsys, 0) / DEEPSPEED_ENGINE_EFFICIENCY, rel=1e-9)
