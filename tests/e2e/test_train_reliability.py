"""Reliability of real training runs: non-finite steps skipped in any precision, preemption by a signal to one
rank (same step saved everywhere, requeue exit code, exact continuation), kill -9 during a checkpoint write and a
truncated newest checkpoint (previous one loads)."""

from __future__ import annotations

import math

import pytest

from tests.distributed.fns_reliability import (
    run_with_nan_many,
)
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


def test_nonfinite_steps_are_skipped_in_any_precision_and_repeats_abort(data: dict[str, str]) -> None:
    common = dict(world=2, train_iters=6, eval_iters=0, log_interval=1)
    jobs = [
        (tiny_config(data, **common), [3], 1),  # fp32, ZeRO-0: NaN on rank 1 only
        (tiny_config(data, **common, bf16={"enabled": True}, zero_optimization={"stage": 1}), [2, 5], 0),
        (tiny_config(data, **common, max_consecutive_nonfinite_steps=3), [2, 3, 4, 5, 6], 1),
    ]
    results = run_distributed(run_with_nan_many, 2, jobs, timeout=600)
    for rank_results in results:
        fp32, bf16, aborted = rank_results
        assert math.isnan(fp32["train_losses"][2]) and fp32["skipped_iters"] == 1
        # the NaN gradients were not applied: every later step trains on finite weights
        assert all(math.isfinite(x) for i, x in enumerate(fp32["train_losses"]) if i != 2)
        assert [i for i, x in enumerate(bf16["train_losses"]) if not math.isfinite(x)] == [1, 4]
        assert bf16["skipped_iters"] == 2 and bf16["zero_stage"] == 1 and bf16["params_dtype"] == "bfloat16"
        assert "NonFiniteAbort: 3 consecutive steps" in aborted["abort"] and "iteration 4" in aborted["abort"]
    rank0 = results[0]
    assert rank0[0]["warnings"] == ["iteration 3: non-finite loss or gradient, step skipped (1 in a row)"]
    assert len(rank0[1]["warnings"]) == 2 and "iteration 5" in rank0[1]["warnings"][1]
