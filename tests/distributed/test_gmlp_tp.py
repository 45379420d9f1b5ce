"""gMLP / aMLP at tensor parallel size 2 on 2 gloo ranks equal GPT-NeoX's TP-2 block computed in one process
(``tests/fixtures/gpt-neox/gmlp_block.json``: GPT-NeoX's ``GMLPBlock`` built as each TP rank, its row-parallel
partial sums added). GPT-NeoX's gMLP is not TP-invariant (each rank normalises and mixes its own slice of the gate,
and has its own tiny attention), so the TP-1 function it must equal is that one-process TP-2 computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.distributed import fns_gmlp
from tests.harness import run_distributed
from tests.unit.test_gmlp_gpt_neox_golden import CASES, close

pytestmark = pytest.mark.distributed

TP2 = [c for c in CASES if c["tp"] == 2]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(fns_gmlp.run_tp2_cases, 2, timeout=240)


@pytest.mark.parametrize("case", TP2, ids=lambda c: c["name"])
def test_two_ranks_give_gpt_neoxs_tp2_block(case: dict, ranks: list[dict]) -> None:
    import torch

    for result in ranks:
        got = result[case["name"]]
        close(torch.from_numpy(got["output"]), case["output"])  # every rank holds the reduced output
        close(torch.from_numpy(got["x_grad"]), case["x_grad"])  # and the full input gradient


@pytest.mark.parametrize("case", TP2, ids=lambda c: c["name"])
def test_gradient_norm_counts_each_ranks_gating_unit(case: dict, ranks: list[dict]) -> None:
    """The sgu parameters are each rank's own (not replicas): the norm sums both ranks' squares; replicated ones
    (the block's input norm) count once; the two unused biases have no gradient."""
    r0, r1 = (r[case["name"]] for r in ranks)
    assert r0["unused"] == r1["unused"] == ["input_linear.bias", "output_linear.bias"]
    want = sum(v for n, v in r0["squares"].items()) + sum(
        v for n, v in r1["squares"].items() if not n.startswith("norm.")
    )
    assert r0["squares"]["norm.weight"] == pytest.approx(r1["squares"]["norm.weight"], rel=1e-6)
    assert r0["grad_norm"] == r1["grad_norm"] == pytest.approx(math.sqrt(want), rel=1e-5)
    assert not np.isclose(r0["squares"]["sgu.proj.weight"], r1["squares"]["sgu.proj.weight"])
