"""Refit the planner's calibrated step-time constants to the published runs, with a leave-one-out check.

    python tools/fit_planner_calibration.py [--loo] [--loso] [--fit-fsdp]

Minimises the mean squared log error plus 0.3 x the squared largest one over the four fitted constants of
``megatron/planner/calibrated.py`` (``BUS_EFFICIENCY`` and ``GEMM_KNEE`` are set, not fitted), starting from the current values; prints the
fitted constants and every run's error (and the error of each run in ``VALIDATION_RUNS``, not fitted), with ``--loo`` each run's error when the constants are refitted without
it, and with ``--loso`` (leave one source out) each run's error when the constants are refitted without every run
of its source (paper or table), with the share of runs within ±15 % and ±25 %; ``--fit-fsdp`` adds llm-foundry's
A100 FSDP rows (``FSDP_A100_RUNS``, otherwise out of sample) to the runs fitted and left out. Needs SciPy (installed with the dev requirements' dependencies; not needed by the planner itself).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.abspath(os.path.dirname(os.path.dirname(__file__))))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.planner.calibrated import Calibration
from megatron.planner.published_runs import PUBLISHED_RUNS, PublishedRun
from megatron.planner.validation_runs import FSDP_A100_RUNS, VALIDATION_RUNS

FITTED = ("gemm_peak_fraction", "activation_traffic", "zero3_overlap", "pipeline_layer_overhead_s")
BOUNDS = ((0.3, 1.0), (0.0, 40.0), (0.0, 1.0), (0.0, 0.1))
# Leave-one-source-out: a constant that no remaining run constrains is held at its ideal value (ZeRO-3 traffic fully
# hidden, no per-layer cost in DeepSpeed's pipeline engine), never at a value fitted with the left-out runs.
IDEAL = {"zero3_overlap": 1.0, "pipeline_layer_overhead_s": 0.0}
RESTARTS = 8  # Nelder-Mead restarts from where the last run stopped, until the loss stops falling
# Where every leave-one-source-out fit starts: round numbers strictly inside the bounds (a start on a bound stalls the
# first simplex, whose steps outside the bounds all cost 1e9).
START = (0.6, 3.0, 0.9, 0.005)


def _calibration(x: Sequence[float]) -> Calibration:
    return Calibration(**{**Calibration().__dict__, **dict(zip(FITTED, (float(v) for v in x), strict=True))})


def _log_errors(x: Sequence[float], runs: Sequence[PublishedRun]) -> list[float]:
    cal = _calibration(x)
    return [math.log(r.predict(cal).tflops_per_gpu / r.published_tflops) for r in runs]


def _loss(x: Sequence[float], runs: Sequence[PublishedRun]) -> float:
    if any(not lo <= v <= hi for v, (lo, hi) in zip(x, BOUNDS, strict=True)):
        return 1e9
    e = _log_errors(x, runs)
    return sum(v * v for v in e) / len(e) + 0.3 * max(abs(v) for v in e) ** 2


def constrained(runs: Sequence[PublishedRun]) -> list[str]:
    """The fitted constants ``runs`` say anything about: the ZeRO-3 overlap needs a ZeRO-3 run, the pipeline engine's
    cost per layer a run on DeepSpeed's pipeline engine."""
    uses = {
        "zero3_overlap": any(r.zero_stage == 3 and r.workload().engine != "pytorch" for r in runs),
        "pipeline_layer_overhead_s": any(r.workload().on_deepspeed_pipeline_engine for r in runs),
    }
    return [name for name in FITTED if uses.get(name, True)]


def fit(
    runs: Sequence[PublishedRun], start: Sequence[float], iters: int = 1500, free: Sequence[str] = FITTED
) -> list[float]:
    """The constants minimising the loss over ``runs``; only those named in ``free`` move from ``start``."""
    from scipy.optimize import minimize  # type: ignore[import-untyped]  # a tool-only dependency

    index = [FITTED.index(name) for name in free]

    def full(y: Sequence[float]) -> list[float]:
        x = [float(v) for v in start]
        for i, v in zip(index, y, strict=True):
            x[i] = float(v)
        return x

    opts = {"maxiter": iters, "xatol": 1e-4, "fatol": 1e-9}
    y = [start[i] for i in index]
    best = _loss(full(y), runs)
    for _ in range(RESTARTS):  # Nelder-Mead stalls on a collapsed simplex: restart from where it stopped
        found = minimize(lambda v: _loss(full(v), runs), y, method="Nelder-Mead", options=opts)
        if found.fun >= best - 1e-12:
            break
        y, best = [float(v) for v in found.x], float(found.fun)
    return full(y)


def fit_without(source: str, runs: Sequence[PublishedRun] = PUBLISHED_RUNS, iters: int = 1500) -> list[float]:
    """The constants fitted on the runs of every source but ``source`` (from :data:`START`; constants those runs do
    not constrain stay at :data:`IDEAL`)."""
    rest = [r for r in runs if r.source != source]
    free = constrained(rest)
    start = [v if name in free else IDEAL[name] for name, v in zip(FITTED, START, strict=True)]
    return fit(rest, start, iters=iters, free=free)


def leave_one_source_out(iters: int = 1500, runs: Sequence[PublishedRun] = PUBLISHED_RUNS) -> list[float]:
    """Each run's relative error when the constants are fitted on the other sources' runs only
    (:func:`fit_without`)."""
    errors = [0.0] * len(runs)
    for source in dict.fromkeys(r.source for r in runs):
        x = fit_without(source, runs, iters)
        for i, run in enumerate(runs):
            if run.source == source:
                errors[i] = math.expm1(_log_errors(x, (run,))[0])
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loo", action="store_true", help="also refit without each run and predict it")
    p.add_argument("--loso", action="store_true", help="also refit without each source and predict its runs")
    p.add_argument(
        "--fit-fsdp", action="store_true", help="fit llm-foundry's A100 FSDP rows too, as an eighth source (a what-if)"
    )
    ns = p.parse_args()
    runs = PUBLISHED_RUNS + (FSDP_A100_RUNS if ns.fit_fsdp else ())
    current = Calibration()
    x = fit(runs, [getattr(current, n) for n in FITTED])
    print("fitted: " + ", ".join(f"{n}={v:.4g}" for n, v in zip(FITTED, x, strict=True)))
    for run, e in zip(runs, _log_errors(x, runs), strict=True):
        print(f"  {run.name:<28} {100 * math.expm1(e):+6.1f}%")
    unfitted = [r for r in VALIDATION_RUNS if r not in runs]
    for run, e in zip(unfitted, _log_errors(x, unfitted), strict=True):
        print(f"  not fitted: {run.name:<32} {100 * math.expm1(e):+6.1f}%")
    if ns.loso:
        errors = leave_one_source_out(runs=runs)
        for run, e in zip(runs, errors, strict=True):
            print(f"  source left out: {run.name:<28} {100 * e:+6.1f}%")
        within = [sum(abs(e) <= band for e in errors) for band in (0.15, 0.25)]
        print(f"  within 15%: {within[0]}/{len(errors)}, within 25%: {within[1]}/{len(errors)}")
    if ns.loo:
        for i, run in enumerate(PUBLISHED_RUNS):
            rest = PUBLISHED_RUNS[:i] + PUBLISHED_RUNS[i + 1 :]
            e = _log_errors(fit(rest, x, iters=400), (run,))[0]
            print(f"  left out {run.name:<28} {100 * math.expm1(e):+6.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
