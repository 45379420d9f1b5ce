"""DeepSpeed universal checkpoints: a neox-forge checkpoint converted by DeepSpeed's own ``ds_to_universal``
(``convert_to_universal``) resumes with ``load_universal`` in another TP/PP/DP layout and ZeRO stage, with the
losses of a plain (non-converted) resume; what DeepSpeed's universal load cannot do is refused with one line.

Layouts are ``(tp, pp, zero)`` on 2 ranks (``pp`` 0: the sequential model; >= 1: the pipeline engine); the
data-parallel size is what the world leaves. Every run resumes from the same step-2 checkpoint and trains 2 steps.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.distributed import fns_universal as fu
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

TP_TOL = 1e-6  # relative: another TP size or engine (pipeline) sums in another order (fp32)


def _assert_like(result: dict, reference: list[float], exact: bool, what: str) -> None:
    assert "error" not in result, f"{what}: {result}"
    assert result["iteration"] == fu.SAVE_AT
    if exact:
        assert result["losses"] == reference, what
    else:
        assert all(math.isclose(a, b, rel_tol=TP_TOL) for a, b in zip(result["losses"], reference, strict=True)), (
            what,
            result["losses"],
            reference,
        )


def _optimizer_state_matters(r: dict) -> None:
    """A resume with a fresh Adam state (weights only) ends far from the uninterrupted run: the comparisons above
    would notice a universal load that lost the moments."""
    assert r["plain"]["losses"] == r["uninterrupted"]
    assert abs(r["fresh_optimizer"]["losses"][-1] - r["uninterrupted"][-1]) > 1000 * TP_TOL


def test_zero1_dp2_checkpoint_resumes_in_other_layouts(tmp_path) -> None:
    targets = [(1, 0, 1), (1, 0, 2), (2, 0, 1), (1, 1, 1), (1, 0, 0), (1, 0, 3)]
    directory = str(tmp_path / "ckpt")
    r = run_distributed(fu.save_convert_resume, 2, directory, (1, 0, 1), targets, None, True, timeout=300)[0]
    _optimizer_state_matters(r)
    plain = r["plain"]["losses"]
    universal = r["universal"]
    assert universal.endswith("global_step2_universal") and os.path.isdir(os.path.join(universal, "zero"))
    _assert_like(r[(1, 0, 1)], plain, True, "same layout")
    _assert_like(r[(1, 0, 2)], plain, True, "ZeRO-1 -> ZeRO-2")
    _assert_like(r[(2, 0, 1)], plain, False, "TP1 DP2 -> TP2 DP1")
    _assert_like(r[(1, 1, 1)], plain, False, "sequential model -> pipeline engine")
    assert r[(1, 0, 0)]["error"].startswith("load_universal needs zero_optimization.stage >= 1")
    assert "a ZeRO-3 checkpoint loads only into ZeRO-3" in r[(1, 0, 3)]["error"]
    assert "engine was built without checkpoint.load_universal" in r["unflagged"]["error"]


def test_pipeline_checkpoint_resumes_in_other_layouts(tmp_path) -> None:
    """PP=2 with tied embeddings (on the first and last stage): DeepSpeed's converter runs on it, and it resumes as
    TP2 in a one-stage pipeline, and as the sequential model on 2 data-parallel ranks."""
    variant = dict(fu.VARIANT, tied=True)
    targets = [(2, 1, 1), (1, 0, 1)]
    r = run_distributed(fu.save_convert_resume, 2, str(tmp_path / "ckpt"), (1, 2, 1), targets, variant, timeout=300)[0]
    _optimizer_state_matters(r)
    plain = r["plain"]["losses"]
    _assert_like(r[(2, 1, 1)], plain, False, "PP2 -> TP2 pipe 1")
    _assert_like(r[(1, 0, 1)], plain, False, "PP2 -> sequential DP2")


def test_zero3_checkpoint_resumes_at_tp1(tmp_path) -> None:
    """ZeRO-3 TP2 -> ZeRO-3 TP1 DP2; DeepSpeed's ZeRO-3 universal load cannot split over TP or feed ZeRO-1/2."""
    targets = [(1, 0, 3), (2, 0, 3), (1, 0, 1)]
    r = run_distributed(fu.save_convert_resume, 2, str(tmp_path / "ckpt"), (2, 0, 3), targets, timeout=300)[0]
    _optimizer_state_matters(r)
    _assert_like(r[(1, 0, 3)], r["plain"]["losses"], False, "ZeRO-3 TP2 -> ZeRO-3 TP1 DP2")
    assert r[(2, 0, 3)]["error"].startswith("load_universal into ZeRO-3 needs model_parallel_size 1")
    assert "a ZeRO-3 checkpoint loads only into ZeRO-3" in r[(1, 0, 1)]["error"]


def test_bf16_zero1_checkpoint_resumes_within_bf16_precision(tmp_path) -> None:
    """bf16 parameters, ZeRO-1 on 2 DP ranks -> TP2 DP1 ZeRO-1 and DP2 ZeRO-2: the fp32 master weights and moments
    come from the universal files, the bf16 copies are cast from them, so the losses agree with a plain resume within
    bf16 rounding (rel 1e-4); a fresh optimizer state ends 1e-3 away (relative)."""
    variant = dict(fu.VARIANT, bf16=True)
    targets = [(2, 0, 1), (1, 0, 2)]
    r = run_distributed(fu.save_convert_resume, 2, str(tmp_path / "ckpt"), (1, 0, 1), targets, variant, timeout=300)[0]
    plain = r["plain"]["losses"]
    assert abs(r["fresh_optimizer"]["losses"][-1] - plain[-1]) > 1e-3 * plain[-1]
    for target in targets:
        got = r[target]
        assert "error" not in got, got
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(got["losses"], plain, strict=True)), (target, got)
