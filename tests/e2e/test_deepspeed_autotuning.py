"""``deepy.py --autotuning tune``: DeepSpeed's own autotuner, with GPT-NeoX's ``autotuning`` block, runs its
experiments on 2 CPU ranks through neox-forge's ``train.py`` (each experiment's DeepSpeed config sets the ranks'
micro-batch, accumulation and ZeRO settings; the engine measures and exits) and writes its optimal config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import PYTHON, run_command

pytestmark = pytest.mark.distributed


def test_deepspeed_autotuner_runs_its_experiments_on_cpu_ranks(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    cfg = tiny_config(data, world=2, train_iters=20, zero_optimization={"stage": 0})
    cfg.pop("global_num_gpus", None)
    cfg.update(num_gpus=2, train_micro_batch_size_per_gpu=1)
    cfg["autotuning"] = {  # GPT-NeoX's block (tune_1-3B.json) with a small search and the folders in tmp_path
        "enabled": True, "fast": True, "start_profile_step": 1, "end_profile_step": 2,
        "max_train_micro_batch_size_per_gpu": 1, "num_tuning_micro_batch_sizes": 1,
        "results_dir": str(results), "exps_dir": str(exps),
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--train_micro_batch_size_per_gpu",
                         "gradient_accumulation_steps ": "--gradient_accumulation_steps"},
    }  # fmt: skip
    config = tmp_path / "tune.yml"
    config.write_text(yaml.safe_dump(cfg))
    out = run_command([PYTHON, "deepy.py", "--autotuning", "tune", "train.py", str(config)], timeout=900).stdout
    assert "--autotuning tune" in out and "LOCAL_SIZE=2" in out  # the launch command deepy printed

    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] > 100_000 and info["activation_mem_per_gpu"] > 0  # measured by train.py's engine
    measured = {
        d.name: json.loads((d / "metrics.json").read_text()) for d in results.iterdir() if (d / "metrics.json").exists()
    }
    assert measured and all(m["throughput"] > 0 and m["latency"] > 0 for m in measured.values()), measured
    for name in measured:  # every experiment ran neox-forge's train.py with the resolved config
        assert "train.py --neox_config" in (results / name / "cmd.txt").read_text()
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 1 and optimal["zero_optimization"]["stage"] == 0
    assert "tuning_space" in (results / "summary.txt").read_text()
