"""exit_interval, extra_save_iters (incl. step 0), keep_last_n_checkpoints, no_save_optim/no_load_optim, log-scale
checkpoints and the torch profiler trace, in real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain, run_pretrain_many, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


def test_checkpoint_schedule_exit_profile_and_no_save_optim(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    a, b = tmp_path / "a", tmp_path / "b"
    configs = [
        tiny_config(
            data,
            train_iters=10,
            save=str(a),
            extra_save_iters=[0, 2],
            checkpoint_factor=3,
            keep_last_n_checkpoints=2,
            exit_interval=7,
            profile=True,
            profile_step_start=2,
            profile_step_stop=3,
            log_dir=str(tmp_path / "logs"),
        ),
        tiny_config(
            data,
            train_iters=9,
            save=str(b),
            checkpoint_factor=2,
            checkpoint_scale="log",
            no_save_optim=True,
            zero_optimization={"stage": 1},
            eval_interval=100,
        ),
    ]
    first, second = run_distributed(run_pretrain_many, 1, configs, timeout=400)[0]
    # saves at 0, 2, 3, 6 then exit at 7 (no final save, no final evaluation); only the last 2 are kept
    assert first["saved"] == [0, 2, 3, 6] and first["iteration"] == 7 and first["test"] == {}
    assert sorted(p.name for p in a.glob("global_step*")) == ["global_step3", "global_step6"]
    trace = json.loads((tmp_path / "logs" / "profile_rank0.json").read_text())
    assert trace["traceEvents"]
    # log scale with factor 2: 1, 2, 4, 8 (+ the final save at 9)
    assert second["saved"] == [1, 2, 4, 8, 9]
    assert not list((b / "global_step8").glob("*optim_states.pt"))
    resumed = run_distributed(
        run_pretrain,
        1,
        tiny_config(data, train_iters=9, load=str(b), iteration=8, no_load_optim=True, zero_optimization={"stage": 1}),
        timeout=300,
    )[0]
    assert resumed["start_iteration"] == 8 and len(resumed["train_losses"]) == 1


def test_train_epochs_sets_train_iters(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data", max_docs=3)
    from megatron.data.indexed_dataset import make_dataset

    tokens = sum(len(d) for d in make_dataset(data["data_path"], "mmap"))
    cfg = tiny_config(data, world=2, eval_interval=100, eval_iters=1, split="98,1,1", train_epochs=2)
    cfg.pop("train_iters")
    run = run_distributed(run_pretrain, 2, cfg, timeout=300)[0]
    # one epoch = ~98% of the packed samples (seq 32 + 1), global batch 8 → about tokens·0.98 / 32 / 8 iterations
    per_epoch = tokens * 0.98 / 32 / 8
    assert abs(run["iteration"] - 2 * per_epoch) <= 2 and len(run["train_losses"]) == run["iteration"]
