"""tools/fit_planner_calibration.py reproduces the constants, and the leave-one-source-out check (issue 37)."""

from __future__ import annotations

import math

import pytest

from megatron.planner.calibrated import Calibration
from megatron.planner.published_runs import AZURE, MEGATRON_T2, PUBLISHED_RUNS
from megatron.planner.validation_runs import FSDP_A100_RUNS
from tests.harness import load_tool

FIT = load_tool("tools/fit_planner_calibration.py")


def test_the_fit_reproduces_the_constants() -> None:
    """Refitting from the constants in calibrated.py lands on them again (within 2 %: the loss is flat there)."""
    pytest.importorskip("scipy")
    current = [getattr(Calibration(), name) for name in FIT.FITTED]
    refit = FIT.fit(PUBLISHED_RUNS, current)
    for name, now, again in zip(FIT.FITTED, current, refit, strict=True):
        assert again == pytest.approx(now, rel=0.02), name
    # The constants' own errors: every run within ±15 % (test_planner_calibration checks each run too).
    assert max(abs(math.expm1(e)) for e in FIT._log_errors(current, PUBLISHED_RUNS)) < 0.15


def test_the_fit_lands_on_the_constants_from_the_round_start() -> None:
    """The leave-one-source-out fits start from ``START``, not from the fitted values: from there the full fit reaches
    the same minimum (it stalled at the round values while they sat on a bound, which made every left-out source's
    prediction one of the round values, not of a fit: docs/planner.md)."""
    pytest.importorskip("scipy")
    assert all(lo < v < hi for v, (lo, hi) in zip(FIT.START, FIT.BOUNDS, strict=True))
    current = [getattr(Calibration(), name) for name in FIT.FITTED]
    for name, now, found in zip(FIT.FITTED, current, FIT.fit(PUBLISHED_RUNS, FIT.START), strict=True):
        assert found == pytest.approx(now, rel=0.01), name


@pytest.mark.slow  # 15 constrained fits with restarts: about 12 s on 2 cores
def test_leave_one_source_out() -> None:
    """Fit on every source but one, predict that one's runs: the numbers docs/planner.md tabulates (33 of 35 within
    ±15 %, all 35 within ±25 %: the issue's targets, 90 % and all). The two misses are Table 2's compute-bound ZeRO-3
    runs, +18 % and +22 % (the overlap then rests on the Azure runs, whose DeepSpeed hid more). With the pipeline
    engine's cost per layer fitted on the other two of its sources, MT-NLG comes out +9-14 % and BLOOM -9 % (with the
    earlier compute-pace factor: +15-20 % and -15 %); the VALIDATION_RUNS are not fitted and leave these counts as
    they are."""
    pytest.importorskip("scipy")
    assert FIT.constrained([r for r in PUBLISHED_RUNS if r.zero_stage != 3]) == [
        "gemm_peak_fraction",
        "activation_traffic",
        "pipeline_layer_overhead_s",
    ]
    # the Azure runs are DeepSpeed's engine without a pipeline: they constrain the overlap, not the per-layer cost
    azure = [r for r in PUBLISHED_RUNS if r.source == AZURE]
    assert FIT.constrained(azure) == ["gemm_peak_fraction", "activation_traffic", "zero3_overlap"]
    errors = dict(zip((r.name for r in PUBLISHED_RUNS), FIT.leave_one_source_out(), strict=True))
    assert len({r.source for r in PUBLISHED_RUNS}) == 7 and len(errors) == 35
    assert sum(abs(e) <= 0.15 for e in errors.values()) == 33
    assert sum(abs(e) <= 0.25 for e in errors.values()) == 35
    assert {name for name, e in errors.items() if abs(e) > 0.15} == {"ZeRO-3 175B 384", "ZeRO-3 530B 640"}
    assert errors["ZeRO-3 175B 384"] == pytest.approx(0.179, abs=0.01)
    assert errors["ZeRO-3 530B 640"] == pytest.approx(0.223, abs=0.01)
    assert errors["MT-NLG 530B 3360"] == pytest.approx(0.144, abs=0.005)
    assert errors["BLOOM-176B"] == pytest.approx(-0.088, abs=0.01)
    korthikanti = [e for name, e in errors.items() if name.startswith("Korthikanti")]
    assert len(korthikanti) == 9 and max(abs(e) for e in korthikanti) < 0.12
    assert max(abs(errors[r.name]) for r in azure) < 0.13
    # Without the Azure source: 27 of 30 within ±15 %, 28 within ±25 % (24 and 28 with the compute-pace factor)
    earlier = FIT.leave_one_source_out(runs=[r for r in PUBLISHED_RUNS if r.source != AZURE])
    assert (
        len(earlier) == 30 and sum(abs(e) <= 0.15 for e in earlier) == 27 and sum(abs(e) <= 0.25 for e in earlier) == 28
    )


@pytest.mark.slow  # 9 fits over 49 runs: about 5 s
def test_fitting_the_fsdp_rows_in() -> None:
    """The what-if docs/planner.md reports: llm-foundry's 14 A100 FSDP rows fitted as an eighth source raise the GEMM
    pace to ~0.71 and leave 46 of 49 runs within ±15 % and 48 within ±25 % when each source is left out (33 and 35 of
    35 without them); the H100 rows, already over-predicted, would rise with the pace, so the rows stay out."""
    pytest.importorskip("scipy")
    runs = PUBLISHED_RUNS + FSDP_A100_RUNS
    x = FIT.fit(runs, [getattr(Calibration(), name) for name in FIT.FITTED])
    assert x[0] == pytest.approx(0.714, abs=0.005)
    errors = FIT.leave_one_source_out(runs=runs)
    assert len(errors) == 49 and sum(abs(e) <= 0.15 for e in errors) == 46 and sum(abs(e) <= 0.25 for e in errors) == 48


def test_the_azure_runs_hid_more_zero3_traffic_than_table_2s() -> None:
    """docs/planner.md, "The Azure source": the ZeRO-3 overlap fitted without Table 2 (on the Azure runs) is 0.880,
    without the Azure runs (on Table 2) 0.800; the full fit's 0.798 sits at Table 2's."""
    pytest.importorskip("scipy")
    overlap = FIT.FITTED.index("zero3_overlap")
    for left_out, expected in ((MEGATRON_T2, 0.880), (AZURE, 0.800)):
        assert FIT.fit_without(left_out)[overlap] == pytest.approx(expected, abs=0.005), left_out
