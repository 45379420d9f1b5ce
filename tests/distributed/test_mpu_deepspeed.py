"""The mpu as DeepSpeed's ``mpu=``: tp2 x dp2 trains exactly like tp1 x dp2 with active gradient clipping."""

from __future__ import annotations

import pytest

from tests.distributed import fns_mpu_train
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 5


@pytest.fixture(scope="module")
def reference() -> dict:
    result = run_distributed(fns_mpu_train.train, 2, 1, STEPS, timeout=240)[0]
    assert result["dp_world_size"] == 2
    # Clipping is active (so an mp-unaware grad norm would change the trajectory) and the model learns.
    assert all(norm > 2 * fns_mpu_train.CLIP for norm in result["grad_norms"]), result["grad_norms"]
    assert result["losses"][-1] < result["losses"][0], result["losses"]
    return result


@pytest.mark.parametrize(
    ("zero_stage", "activation_checkpointing"), [(1, False), (3, True)], ids=["zero1", "zero3-ckpt"]
)
def test_tp2_dp2_matches_tp1_dp2(reference: dict, zero_stage: int, activation_checkpointing: bool) -> None:
    sharded = run_distributed(fns_mpu_train.train, 4, 2, STEPS, zero_stage, activation_checkpointing, timeout=300)
    for result in sharded:
        assert result["dp_world_size"] == 2
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4)
        # Replicated parameters stay in sync inside each TP group and match the TP-1 run.
        assert result["fc2_bias"] == pytest.approx(reference["fc2_bias"], abs=1e-5)
        assert result["norm1_weight"] == pytest.approx(reference["norm1_weight"], abs=1e-5)
    assert sharded[0]["fc2_bias"] == sharded[1]["fc2_bias"]
    assert sharded[2]["norm1_weight"] == sharded[3]["norm1_weight"]
