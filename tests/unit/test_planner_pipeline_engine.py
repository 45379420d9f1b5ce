"""DeepSpeed's pipeline engine's cost per layer and micro-batch (docs/planner.md, "The pipeline engine's cost per
layer"), checked out of sample on BigScience's micro-batch sweep for BLOOM, which the constants are not fitted to."""

from __future__ import annotations

import json

import pytest

import deepy
from megatron.planner.calibrated import PIPELINE_LAYER_OVERHEAD_S, Calibration
from megatron.planner.published_runs import PUBLISHED_RUNS, PublishedRun
from megatron.planner.validation_runs import BLOOM_SHAPE, BLOOM_SIZING_RUNS, VALIDATION_RUNS
from tests.harness import load_tool

FIT = load_tool("tools/fit_planner_calibration.py")


# BLOOM's shape at micro-batch 1 to 8: the micro-batch sweep
MICRO_BATCH_SWEEP = [r for r in BLOOM_SIZING_RUNS if (r.hidden_size, r.num_layers) == BLOOM_SHAPE]


def _sweep(pp: int) -> list[PublishedRun]:
    return sorted((r for r in MICRO_BATCH_SWEEP if r.pp == pp), key=lambda r: r.micro_batch)


def test_the_sweep_is_the_sources_rows_and_out_of_sample() -> None:
    assert set(BLOOM_SIZING_RUNS) <= set(VALIDATION_RUNS) and not set(BLOOM_SIZING_RUNS) & set(PUBLISHED_RUNS)
    assert [(r.pp, r.dp, r.micro_batch) for r in MICRO_BATCH_SWEEP] == [
        (12, 4, 1), (12, 4, 2), (12, 4, 4), (12, 4, 8), (6, 8, 1), (6, 8, 2), (6, 8, 4)
    ]  # fmt: skip
    assert len(BLOOM_SIZING_RUNS) == 17 and {(r.hidden_size, r.num_layers) for r in BLOOM_SIZING_RUNS} == {
        (14336, 72), (13824, 84), (12288, 96), (13312, 84), (13824, 78)
    }  # fmt: skip
    for run in BLOOM_SIZING_RUNS:  # 48 nodes, about BLOOM's size (177B to 196B)
        assert (run.tp, run.gpus, run.train_batch, run.num_heads) == (8, 384, 2048, 64)
        assert run.num_layers % run.pp == 0 and run.workload().on_deepspeed_pipeline_engine
        params = 12 * run.num_layers * run.hidden_size**2 + run.padded_vocab_size * run.hidden_size
        assert 176e9 < params < 197e9


def test_every_row_of_the_sweep_is_predicted_within_6_percent() -> None:
    """BLOOM's shape at 7 layouts and four other shapes at 10: -1.7 ... +5.9 %."""
    errors = [r.predict().tflops_per_gpu / r.published_tflops - 1 for r in BLOOM_SIZING_RUNS]
    assert min(errors) > -0.02 and max(errors) < 0.06


@pytest.mark.parametrize("pp", [12, 6])
def test_the_cost_per_layer_turns_the_micro_batch_trend_the_way_the_sweep_went(pp: int) -> None:
    """Published: micro-batch 4 is about 16 % faster than 1 (the bubble grows with the micro-batch, so without a
    fixed cost per micro-batch the model ranks micro-batch 1 first); micro-batch 8 falls back (PP 12)."""
    runs = _sweep(pp)
    published = [r.published_tflops for r in runs]
    with_cost = [r.predict().tflops_per_gpu for r in runs]
    without = [r.predict(Calibration(pipeline_layer_overhead_s=0.0)).tflops_per_gpu for r in runs]
    assert published[2] / published[0] == pytest.approx(1.155, abs=0.01)
    assert without == sorted(without, reverse=True)  # every bigger micro-batch predicted slower
    assert with_cost[0] < with_cost[1] < with_cost[2]  # as published
    assert with_cost[2] / with_cost[0] == pytest.approx({12: 1.19, 6: 1.20}[pp], abs=0.005)
    if pp == 12:
        assert published[3] < published[2] and with_cost[3] < with_cost[2]


def test_the_sweep_alone_gives_about_the_fitted_cost() -> None:
    """Fitting only the cost per layer to the 7 rows (the other constants as fitted) gives 14 ms; with the GEMM pace
    free as well 11.6 ms: the 12.8 ms fitted on MT-NLG, BLOOM and GPT-NeoX-20B sits between."""
    pytest.importorskip("scipy")
    current = [getattr(Calibration(), name) for name in FIT.FITTED]
    i = FIT.FITTED.index("pipeline_layer_overhead_s")
    alone = FIT.fit(MICRO_BATCH_SWEEP, current, free=["pipeline_layer_overhead_s"])[i]
    with_pace = FIT.fit(MICRO_BATCH_SWEEP, current, free=["gemm_peak_fraction", "pipeline_layer_overhead_s"])[i]
    assert alone == pytest.approx(0.0140, abs=0.0005) and with_pace == pytest.approx(0.0116, abs=0.0005)
    assert with_pace < PIPELINE_LAYER_OVERHEAD_S < alone


def test_the_cost_is_per_layer_of_the_busiest_stage_and_micro_batch() -> None:
    for run in PUBLISHED_RUNS:
        w, p = run.workload(), run.predict()
        expected = PIPELINE_LAYER_OVERHEAD_S * w.layers_per_stage * w.gas if w.on_deepspeed_pipeline_engine else 0.0
        assert p.engine_overhead_s == pytest.approx(expected, rel=1e-12), run.name
        assert (p.engine_overhead_s > 0) == (
            run.framework in ("gpt-neox", "megatron-deepspeed") and run.pipeline_engine
        )


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_a_plan_says_when_the_cost_outweighs_the_gemms(capsys: pytest.CaptureFixture[str]) -> None:
    """125M (12 layers of width 768, micro-batch 4) on DeepSpeed's pipeline engine: the cost per layer is larger than
    the GEMM time, which no calibration run checks; the plan says so. The 20B's is a tenth of its step: no warning."""
    small = _plan(capsys, "configs/125M.yml", "--gpus", "8")
    p = small["throughput"]["predicted"]
    assert (
        p["engine_overhead_s"] == pytest.approx(PIPELINE_LAYER_OVERHEAD_S * 12, rel=1e-12)
        and p["engine_overhead_s"] > p["gemm_s"]
    )
    assert any(
        w.startswith("DeepSpeed's pipeline engine: its fitted cost per layer and micro-batch (0.15 s per step) exceeds "
                     "the GEMM time (0.05 s)")
        for w in small["warnings"]
    )  # fmt: skip
    unpiped = _plan(capsys, "configs/125M.yml", "--gpus", "8", "--pipe_parallel_size", "0")
    assert unpiped["throughput"]["predicted"]["engine_overhead_s"] == 0.0
    assert not any("cost per layer" in w for w in unpiped["warnings"])
    big = _plan(capsys, "configs/20B.yml", "--gpus", "96")
    assert not any("cost per layer" in w for w in big["warnings"])


@pytest.mark.parametrize("pipe", [0, 1])
def test_the_search_plans_one_stage_as_configured(capsys: pytest.CaptureFixture[str], pipe: int) -> None:
    """A one-stage ZeRO-0/1 candidate keeps the configured pipe_parallel_size (0: no PipelineModule, no per-layer
    cost; 1: the pipeline engine's), so the configured layout's row is predicted as ``--plan`` predicts it; the table
    writes pipe_parallel_size (PP 0 or PP 1)."""
    argv = ["configs/125M.yml", "--gpus", "8", "--pipe_parallel_size", str(pipe)]
    plan = _plan(capsys, *argv)["throughput"]["predicted"]
    result = _plan(capsys, *argv, "--search", "--top", "1000")
    ours = result["layouts"][result["configured_rank"] - 1]
    assert ours["pipe_parallel_size"] == pipe and ours["step_s"] == pytest.approx(plan["step_s"], rel=1e-9)
    for c in result["layouts"]:
        if c["pipe_parallel_size"] <= 1:
            assert c["pipe_parallel_size"] == (0 if c["zero_stage"] >= 2 else pipe)
    assert deepy.main(["--plan", "train.py", *argv, "--search", "--top", "3"]) == 0
    assert f"x PP {pipe} x DP 8, ZeRO-1, micro 4 x 1" in capsys.readouterr().out


@pytest.mark.parametrize("pp", [12, 6])
def test_the_sweep_itself_implies_about_11_ms_per_layer(pp: int) -> None:
    """docs/planner.md: a step of ``(m + p - 1)`` slots of ``b·t + c`` (``m`` micro-batches of size ``b``, ``p``
    stages) through the published micro-batch 1 and 4 steps gives ``c`` about 11 ms per layer at both stage counts
    (69 ms for 6 layers, 127 ms for 12): the cost does not depend on the micro-batch, and scales with the layers."""
    one, four = (r for r in _sweep(pp) if r.micro_batch in (1, 4))
    w = one.workload()
    seconds = [w.flops(4) / (r.published_tflops * 1e12 * r.gpus) for r in (one, four)]  # the logged formula, inverted
    slots = [r.gas + pp - 1 for r in (one, four)]
    t = (seconds[1] / slots[1] - seconds[0] / slots[0]) / 3  # (4t + c) - (t + c)
    c = seconds[0] / slots[0] - t
    assert c == pytest.approx({12: 0.069, 6: 0.127}[pp], abs=0.002)
    assert 0.0100 < c / w.layers_per_stage < 0.0120


def test_the_costs_share_of_the_fitted_runs_steps() -> None:
    """docs/planner.md: 15 % of MT-NLG's step on 2240 GPUs, 9 % of BLOOM's, 10 % of GPT-NeoX-20B's."""
    rows = {r.name: r.predict() for r in PUBLISHED_RUNS}
    shares = {name: rows[name].engine_overhead_s / rows[name].step_s for name in ("MT-NLG 530B 2240", "BLOOM-176B")}
    shares["GPT-NeoX-20B"] = rows["GPT-NeoX-20B"].engine_overhead_s / rows["GPT-NeoX-20B"].step_s
    assert {k: round(v, 2) for k, v in shares.items()} == {
        "MT-NLG 530B 2240": 0.15,
        "BLOOM-176B": 0.09,
        "GPT-NeoX-20B": 0.10,
    }


@pytest.mark.slow  # three constrained fits: a few seconds
def test_the_cost_with_each_pipeline_engine_source_left_out() -> None:
    """docs/planner.md: 6.7 ms with MT-NLG left out (BLOOM and the 20B alone), 13.7 ms without BLOOM, 13.1 without
    the 20B."""
    pytest.importorskip("scipy")
    from megatron.planner.published_runs import BLOOM, MTNLG, NEOX_PAPER

    i = FIT.FITTED.index("pipeline_layer_overhead_s")
    for source, expected in ((MTNLG, 0.0067), (BLOOM, 0.0137), (NEOX_PAPER, 0.0131)):
        assert FIT.fit_without(source)[i] == pytest.approx(expected, abs=0.0003), source


def test_the_20b_searches_docs_planner_md_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """With its ZeRO stage, micro-batch and checkpointing fixed the paper's layout ranks first; in the full search it
    ranks 17th of 61, behind 16 one-stage layouts without a PipelineModule (PP 0, ZeRO-2/3), each ahead by the
    engine's cost per layer and the bubble."""
    fixed = _plan(capsys, "configs/20B.yml", "--gpus", "96", "--search", "--search-fix", "zero,micro,ckpt")
    assert fixed["configured_rank"] == 1
    full = _plan(capsys, "configs/20B.yml", "--gpus", "96", "--search", "--top", "1000")
    assert (full["configured_rank"], full["layouts_that_fit"]) == (17, 61)
    for e in full["above_configured"]:
        assert e["layout"]["pipe_parallel_size"] == 0 and e["layout"]["zero_stage"] >= 2
        assert e["term_deltas_s"]["engine"] < 0 and e["term_deltas_s"]["bubble"] < 0
