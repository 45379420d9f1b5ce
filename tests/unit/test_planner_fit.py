"""tools/fit_planner_calibration.py reproduces the constants, and the leave-one-source-out check (issue 37)."""

from __future__ import annotations

import math

import pytest

from megatron.planner.calibrated import Calibration
from megatron.planner.published_runs import FSDP_A100_RUNS, PUBLISHED_RUNS
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


def test_leave_one_source_out() -> None:
    """Fit on every source but one, predict that one's runs: the numbers docs/planner.md tabulates (27 of 30 within
    ±15 %, 28 within ±25 %: the issue's first target, 90 % within ±15 %, is met, the second, all within ±25 %, is not:
    the ZeRO-3 runs at 4 micro-batch samples, +32 % and +36 %, when Table 2, the only fitted ZeRO-3 source, is left
    out; Korthikanti et al.'s nine runs, the sixth source, all within ±15 % when left out; torchtitan's FSDP rows are
    VALIDATION_RUNS, not fitted, and leave these counts as they are, as do llm-foundry's A100 FSDP rows)."""
    pytest.importorskip("scipy")
    assert FIT.constrained([r for r in PUBLISHED_RUNS if r.zero_stage != 3]) == [
        "gemm_peak_fraction",
        "activation_traffic",
        "deepspeed_engine_efficiency",
    ]
    errors = dict(zip((r.name for r in PUBLISHED_RUNS), FIT.leave_one_source_out(), strict=True))
    assert len({r.source for r in PUBLISHED_RUNS}) == 6 and len(errors) == 30
    assert sum(abs(e) <= 0.15 for e in errors.values()) == 27
    assert sum(abs(e) <= 0.25 for e in errors.values()) == 28
    assert errors["ZeRO-3 175B 384"] == pytest.approx(0.32, abs=0.02)
    assert errors["ZeRO-3 530B 640"] == pytest.approx(0.36, abs=0.02)
    assert errors["MT-NLG 530B 3360"] == pytest.approx(0.185, abs=0.02)
    korthikanti = [e for name, e in errors.items() if name.startswith("Korthikanti")]
    assert len(korthikanti) == 9 and max(abs(e) for e in korthikanti) < 0.15


def test_fitting_the_fsdp_rows_in_makes_leave_one_source_out_worse() -> None:
    """The what-if docs/planner.md reports: llm-foundry's 14 A100 FSDP rows fitted as a seventh source raise the GEMM
    pace to ~0.70 and leave 30 of 44 runs within ±15 % when each source is left out (27 of 30 without them)."""
    pytest.importorskip("scipy")
    runs = PUBLISHED_RUNS + FSDP_A100_RUNS
    x = FIT.fit(runs, [getattr(Calibration(), name) for name in FIT.FITTED])
    assert x[0] == pytest.approx(0.70, abs=0.01)
    errors = FIT.leave_one_source_out(runs=runs)
    assert len(errors) == 44 and sum(abs(e) <= 0.15 for e in errors) == 30
