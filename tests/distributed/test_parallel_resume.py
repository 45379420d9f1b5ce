"""Checkpoint under TP=2 × PP=2 and resume: the continuation equals the uninterrupted run exactly."""

from __future__ import annotations

import pytest

from tests.distributed import fns_parallel as fp
from tests.distributed import fns_parallel_resume as fr
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


def test_tp2_pp2_resume_is_exact(tmp_path) -> None:
    results = run_distributed(fr.save_and_resume, 4, 2, 2, str(tmp_path / "ckpt"), timeout=300)
    r0 = results[0]
    assert r0["iteration"] == fr.SAVE_AT
    for rank, result in enumerate(results):
        assert result["resumed"] == result["uninterrupted"], f"rank {rank}: resumed run diverged"
    assert len(r0["uninterrupted"]) == fr.TOTAL - fr.SAVE_AT
    assert fp.max_abs_diff(r0["full_a"], r0["full_b"]) == 0.0
    # GPT-NeoX/DeepSpeed pipeline layout: per-layer files per TP rank, one mp_rank file per (stage, TP rank).
    files = set(r0["files"])
    layers = [0, *range(2, fp.LAYERS + 2), fp.LAYERS + 3]  # tied head (L+4) is stored with layer 0
    for layer in layers:
        for tp_rank in range(2):
            assert f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt" in files, sorted(files)
    assert {f"mp_rank_{i:02d}_model_states.pt" for i in range(4)} <= files, sorted(files)
    assert any(name.startswith("zero_pp_rank_0_mp_rank_") and name.endswith("_optim_states.pt") for name in files)
