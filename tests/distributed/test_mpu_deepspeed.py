"""The mpu as DeepSpeed's ``mpu=``: tp2 x dp2 with ZeRO-1 and active clipping trains exactly like tp1 x dp2."""

from __future__ import annotations

import pytest

from tests.distributed import fns_mpu_train
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 5


def test_tp2_dp2_zero1_matches_tp1_dp2() -> None:
    reference = run_distributed(fns_mpu_train.train, 2, 1, STEPS, timeout=240)
    sharded = run_distributed(fns_mpu_train.train, 4, 2, STEPS, timeout=300)
    ref = reference[0]
    assert ref["dp_world_size"] == 2 and all(r["dp_world_size"] == 2 for r in sharded)
    # Clipping is active (so an mp-unaware grad norm would change the trajectory) and the model learns.
    assert all(norm > 2 * fns_mpu_train.CLIP for norm in ref["grad_norms"]), ref["grad_norms"]
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]
    for result in sharded:
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert result["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
        # Replicated parameters stay in sync inside each TP group and match the TP-1 run.
        assert result["fc2_bias"] == pytest.approx(ref["fc2_bias"], abs=1e-5)
        assert result["norm1_weight"] == pytest.approx(ref["norm1_weight"], abs=1e-5)
    assert sharded[0]["fc2_bias"] == sharded[1]["fc2_bias"]
    assert sharded[2]["norm1_weight"] == sharded[3]["norm1_weight"]
