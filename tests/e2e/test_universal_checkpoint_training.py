"""``train.py``'s path end to end: a ZeRO-1 run on 2 data-parallel ranks saves, ``tools/ckpts/convert_to_universal.py``
(run as a program) converts the checkpoint with DeepSpeed's ``ds_to_universal``, and runs with ``load_universal:
true`` at TP=2 and at ZeRO-2 continue with the uninterrupted run's losses (LR schedule, data position and the
optimizer state restored)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain, run_pretrain_each, tiny_config
from tests.harness import REPO_ROOT, run_command, run_distributed

pytestmark = pytest.mark.distributed


def test_train_convert_with_the_tool_resume_with_load_universal(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    common = dict(world=2, train_iters=4, eval_iters=0, checkpoint_factor=2, zero_optimization={"stage": 1})
    full = run_distributed(run_pretrain, 2, tiny_config(data, **common, save=str(tmp_path / "a")), timeout=600)[0]
    assert full["saved"] == [2, 4]
    tool = str(REPO_ROOT / "tools" / "ckpts" / "convert_to_universal.py")
    done = run_command([sys.executable, tool, "--input_dir", str(tmp_path / "a"), "--iteration", "2"])
    universal = tmp_path / "a" / "global_step2_universal"
    assert f"universal checkpoint {universal}" in done.stdout
    assert (tmp_path / "a" / "latest_universal").read_text() == "global_step2_universal"
    load = dict(common, load=str(tmp_path / "a"), load_universal=True)
    targets = [
        tiny_config(data, **load, model_parallel_size=2, gradient_accumulation_steps=2),  # TP1 DP2 -> TP2 DP1
        tiny_config(data, **{**load, "zero_optimization": {"stage": 2}}),  # ZeRO-1 -> ZeRO-2
    ]
    tp2, zero2 = run_distributed(run_pretrain_each, 2, targets, timeout=600)[0]
    assert tp2[0] == pytest.approx(full["train_losses"][2:], rel=1e-5), (tp2, full["train_losses"])
    assert zero2[0] == full["train_losses"][2:]
