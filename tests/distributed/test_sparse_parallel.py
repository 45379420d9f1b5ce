"""Sparse attention under tensor parallelism: the heads (and their layouts) split over 2 TP ranks train exactly like
one process, with every sparse type in one model (a layout per head, random blocks included).

Runs ``fns_parallel.run_layout`` (the parity matrix's harness: 5 steps, eval, full weights in GPT-NeoX names)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import fns_parallel as fp
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

SPARSE = (
    "sparse-tp",
    {
        "tied": True,
        "zero": 1,
        "model": {
            "num_layers": 4,
            "seq_length": 16,  # the layouts are made at seq_length, as GPT-NeoX makes them
            "attention_config": [[["sparse_fixed", "sparse_variable", "bigbird", "bslongformer"], 1]],
            "sparsity_config": {
                "block": 2,  # 16 tokens: 8 blocks
                "different_layout_per_head": True,
                "num_different_global_patterns": 2,
                "num_random_blocks": 1,
                "local_window_blocks": [1, 2],
            },
            "attention_dropout": 0.0,
        },
    },
)


def test_sparse_layers_at_tp2_equal_one_process() -> None:
    ref = run_distributed(fp.run_layout, 1, 1, 1, [SPARSE], timeout=300)[0]["sparse-tp"]
    got = run_distributed(fp.run_layout, 2, 2, 1, [SPARSE], timeout=300)
    assert got[0]["layout"] == (2, 1, 1)
    ours = got[0]["sparse-tp"]
    assert len(ref["losses"]) == fp.STEPS and all(np.isfinite(ref["losses"]))
    assert ref["losses"][-1] < ref["losses"][0] - 0.02, ref["losses"]  # it learns
    assert fp.max_abs_diff(ours["init"], ref["init"]) == 0.0
    assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert abs(ours["eval"] - ref["eval"]) <= 1e-5
    assert fp.max_abs_diff(ours["final"], ref["final"]) <= 1e-5
    assert got[1]["sparse-tp"]["losses"] == pytest.approx(ours["losses"], abs=1e-7)
