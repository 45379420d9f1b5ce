"""The multi-rank harness itself: collectives, failure reporting, and a real DeepSpeed engine."""

from __future__ import annotations

import itertools

import pytest

from tests.distributed import fns_basic
from tests.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def test_four_rank_all_reduce_and_all_gather() -> None:
    results = run_distributed(fns_basic.collectives, 4, timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["world"] == 4
        assert r["omp"] == "1" and r["threads"] == 1
        assert r["sum"] == 1 + 2 + 3 + 4
        assert r["gathered"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 4.0], [3.0, 9.0]]


def test_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(DistributedTestError, match="deliberate failure on rank 1"):
        run_distributed(fns_basic.fail_on_rank, 2, 1, timeout=120)


def test_two_rank_deepspeed_zero1_trains() -> None:
    losses = run_distributed(fns_basic.deepspeed_toy_training, 2, 1, 12, timeout=180)
    assert losses[0] == losses[1], "ranks must agree on the all-reduced loss"
    trajectory = losses[0]
    assert len(trajectory) == 12
    assert all(b < a for a, b in itertools.pairwise(trajectory)), trajectory
    assert trajectory[-1] < 0.5 * trajectory[0], trajectory


def test_tensor_results_survive_rank_exit() -> None:
    results = run_distributed(fns_basic.return_tensors, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["t"].shape == (3, 4) and float(r["t"].sum()) == 12.0 * rank
        assert r["nested"][0].tolist() == [i * rank for i in range(5)]
