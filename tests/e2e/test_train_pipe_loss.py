"""The pipeline step's loss comes from its one decision at DeepSpeed's optimizer step (no read of what
``train_batch`` returns): it equals DeepSpeed's aggregated loss on every rank of every layout, and a NaN loss or a
loss spike under a pipeline of two stages skips the step as the sequential step does."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.distributed.fns_pipe_step import run_recording_pipe_losses
from tests.distributed.fns_reliability import run_with_nan_many
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

ITERS = 3
# world -> layouts (pipe_parallel_size 1 is DeepSpeed's pipeline engine with one stage)
LAYOUTS: dict[int, list[dict[str, Any]]] = {
    1: [{"pipe_parallel_size": 1}, {"pipe_parallel_size": 1, "gradient_accumulation_steps": 2}],
    2: [
        {"pipe_parallel_size": 2},
        {"pipe_parallel_size": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}},
        {"pipe_parallel_size": 1, "gradient_accumulation_steps": 2},  # dp 2
    ],
    4: [
        {"pipe_parallel_size": 2},  # dp 2
        {"pipe_parallel_size": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}},  # dp 2
        {"pipe_parallel_size": 2, "model_parallel_size": 2, "gradient_accumulation_steps": 2},  # tp 2, dp 1
    ],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_the_pipeline_step_reports_deepspeeds_loss_on_every_rank(data: dict[str, str], world: int) -> None:
    """Bit for bit: the step divides the last stage's loss sum by gas as DeepSpeed does (the same tensor op), and
    its world all-reduce adds exact zeros to at most two non-zero values (dp <= 2 here), as DeepSpeed's data-parallel
    all-reduce adds those values; with more data-parallel ranks the summation order could differ by fp32 rounding."""
    common = dict(world=world, train_iters=ITERS, eval_interval=100, eval_iters=0, log_interval=1)
    configs = [tiny_config(data, **common, **layout) for layout in LAYOUTS[world]]
    results = run_distributed(run_recording_pipe_losses, world, configs, timeout=900)
    for layout, *per_rank in zip(LAYOUTS[world], *results, strict=True):
        first = per_rank[0]["reported"]
        assert len(first) == ITERS and all(math.isfinite(x) for x in first), (layout, first)
        assert len(set(first)) == ITERS, f"{layout}: the same loss every iteration: {first}"
        for rank, got in enumerate(per_rank):
            assert got["reported"] == got["deepspeed"], (layout, rank, got)  # exact float equality
            assert got["train_losses"] == got["reported"], (layout, rank)  # what the loop logs
            assert got["reported"] == first, f"{layout}: rank {rank} {got['reported']} != rank 0 {first}"


def test_nan_losses_and_loss_spikes_skip_the_pipeline_step(data: dict[str, str]) -> None:
    """Two stages (rank 1 computes the loss): a NaN loss at iteration 3, and a loss x30 at iteration 5 against a
    window of 3 steps, are skipped on both ranks, and rank 0 (no loss of its own) logs the skip."""
    common = dict(world=2, pipe_parallel_size=2, train_iters=6, eval_iters=0, log_interval=1)
    spikes = dict(loss_spike_skip_window=3, loss_spike_skip_zscore=4.0)
    jobs = [
        (tiny_config(data, **common), [3], 1),
        (tiny_config(data, **common, **spikes), [5], 1, 30.0),
        (tiny_config(data, **common, **spikes), [], 1),  # the same run unpoisoned
    ]
    results = run_distributed(run_with_nan_many, 2, jobs, timeout=900)
    for nan, spiked, clean in results:
        assert math.isnan(nan["train_losses"][2]) and nan["skipped_iters"] == 1
        assert all(math.isfinite(x) for i, x in enumerate(nan["train_losses"]) if i != 2)
        assert nan["train_losses"][:2] == clean["train_losses"][:2] and clean["skipped_iters"] == 0
        assert spiked["skipped_iters"] == 1 and spiked["train_losses"][4] > 10 * spiked["train_losses"][3]
        assert spiked["train_losses"][:4] == clean["train_losses"][:4]
        # the spike's gradients were not applied: the next step trains from the weights of step 4
        assert spiked["train_losses"][5] != clean["train_losses"][5]
        assert spiked["train_losses"][5] < spiked["train_losses"][3] + 0.5
        # the LR schedule moves after applied steps only: a skipped iteration's successor gets the same LR
        assert nan["lrs"][2] == nan["lrs"][3] and spiked["lrs"][4] == spiked["lrs"][5], (nan["lrs"], spiked["lrs"])
        assert len(set(clean["lrs"])) == 6 and clean["lrs"][:3] == nan["lrs"][:3]
    assert results[0][0]["warnings"] == ["iteration 3: non-finite loss or gradient, step skipped (1 in a row)"]
    assert len(results[0][1]["warnings"]) == 1
    assert results[0][1]["warnings"][0].startswith("iteration 5: loss spike, step skipped")
    assert not results[1][0]["warnings"] and not results[1][1]["warnings"]  # rank 0 logs
