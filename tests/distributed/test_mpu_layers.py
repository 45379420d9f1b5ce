"""Tensor-parallel layers and vocab-parallel cross entropy on 2 and 4 gloo ranks vs. the unsharded (TP 1) op."""

from __future__ import annotations

import pytest
import torch

from megatron import mpu
from tests.distributed import fns_mpu
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    mpu.destroy_model_parallel()
    return {name: fns_mpu.run_case(name) for name in fns_mpu.CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def sharded(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, dict[str, torch.Tensor]]]]:
    tp = request.param
    return tp, run_distributed(fns_mpu.run_all_cases, tp, tp, timeout=240)


@pytest.mark.parametrize("case", list(fns_mpu.CASES))
def test_layer_matches_unsharded(case: str, reference, sharded) -> None:
    tp, results = sharded
    expected = reference[case]
    for rank, result in enumerate(results):
        got = result[case]
        assert set(got) == set(expected)
        for key, want in expected.items():
            have = torch.from_numpy(got[key])
            assert have.shape == want.shape, (case, key, rank)
            if key == "weight":
                # Layout-invariant init: the gathered shards ARE the TP-1 weight, bit for bit.
                assert torch.equal(have, want), (case, tp, rank)
            else:
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=f"{case}/{key} tp={tp} rank={rank}")
