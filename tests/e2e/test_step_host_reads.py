"""One host read per optimizer step: the training step keeps its losses, non-finite flag, metrics and the
preemption flag on the device and reads them back once, together (tests/distributed/fns_step_syncs.py counts every
Tensor.item / tolist / cpu / numpy / __float__ / __int__ / __bool__ made by megatron/ code in a real run)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.fns_step_syncs import host_reads_per_iteration
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize(
    ("layout", "per_step"),
    [
        ({"gradient_accumulation_steps": 2}, 1),
        ({"zero_optimization": {"stage": 1}}, 1),
        # the pipeline's loss is read in the decision at DeepSpeed's optimizer step, not from train_batch's return
        ({"pipe_parallel_size": 1, "gradient_accumulation_steps": 2}, 1),
    ],
)
def test_one_host_read_per_training_step(data: dict[str, str], layout: dict[str, Any], per_step: int) -> None:
    cfg = tiny_config(data, train_iters=5, eval_interval=100, eval_iters=0, log_interval=2, **layout)
    got = run_distributed(host_reads_per_iteration, 1, cfg, timeout=600)[0]
    windows = got["windows"][1:-1]  # between two iterations' on_step calls: the logging of one, the step of the next
    assert len(windows) == 4 and len(got["losses"]) == 5
    assert got["on_step"] == list(enumerate(got["losses"], 1))  # pretrain's on_step: every step, in order
    for i, reads in enumerate(windows, 1):
        assert len(reads) <= per_step, f"iteration {i + 1}: {len(reads)} host reads: {reads}"
    assert any(r.startswith("tolist nonfinite.py") for r in windows[0]), windows[0]
