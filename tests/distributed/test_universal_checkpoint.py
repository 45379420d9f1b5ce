"""DeepSpeed universal checkpoints: a checkpoint converted by DeepSpeed's own ds_to_universal resumes with
load_universal in other layouts with the losses of a plain resume."""

from __future__ import annotations

import pytest

from tests.distributed import fns_universal as fu
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


def test_dp2_zero1_universal_resumes(tmp_path) -> None:
    r = run_distributed(fu.save_convert_resume, 2, str(tmp_path / "ckpt"), (1, 1), [(1, 1), (1, 2), (2, 1), (1, 0)], timeout=300)
    for k, v in r[0].items():
        print(k, v)
    assert 0
