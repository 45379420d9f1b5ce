"""The parity matrix's comparison helper cannot be fooled by NaN or inf on one side."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.fns_parallel import max_abs_diff


def test_max_abs_diff_catches_nan_and_inf_injected_into_one_rank():
    ref = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
    assert max_abs_diff(ref, {k: v.copy() for k, v in ref.items()}) == 0.0
    for bad in (np.nan, np.inf):
        other = {k: v.copy() for k, v in ref.items()}
        other["w"][1, 2] = bad
        assert max_abs_diff(ref, other) == float("inf")
        assert max_abs_diff(other, ref) == float("inf")
    close = {k: v.copy() for k, v in ref.items()}
    close["b"][0] = 3e-6
    assert max_abs_diff(ref, close) == pytest.approx(3e-6, rel=1e-3)
