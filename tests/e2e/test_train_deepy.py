"""``deepy.py train.py`` on 2 CPU ranks (DP=2) over real preprocessed data: loss decreases, eval runs, a
checkpoint with GPT-NeoX's files is written, TensorBoard and offline W&B hold the scalars; then generate.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from megatron.logging.wandb_reader import find_run_files, read_wandb_history
from tests.distributed.fns_train import deepy_train, make_tiny_data, tensorboard_scalars, tiny_config
from tests.harness import PYTHON, free_port, run_command

pytestmark = pytest.mark.distributed


def test_deepy_train_two_ranks_then_generate(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    run = tmp_path / "run"
    cfg = tiny_config(
        data,
        world=2,
        train_iters=30,
        eval_interval=15,
        eval_iters=2,
        log_interval=5,
        zero_optimization={"stage": 1},
        save=str(run / "ckpt"),
        load=str(run / "ckpt"),
        checkpoint_factor=15,
        tensorboard_dir=str(run / "tb"),
        log_dir=str(run / "logs"),
        use_wandb=True,
        wandb_project="neox-forge-test",
        log_grad_norm=True,
        log_param_norm=True,
        wall_clock_breakdown=True,
        peak_theoretical_tflops=1.0,
        master_port=free_port(),
    )
    config_file = tmp_path / "tiny_e2e.yml"
    out = deepy_train(cfg, config_file, world=2)
    assert "training finished at iteration 30" in out
    lines = [ln for ln in out.splitlines() if re.match(r"^iteration\s+\d+/\s+30 \|", ln)]
    assert len(lines) == 6  # every log_interval
    assert "MFU (%)" in lines[0] and "tokens/sec" in lines[0] and "grad norm" in lines[0]
    assert "FLOPs per iteration formula: 24·K·B·s·l·h²" in out and "time (ms) | forward:" in out
    losses = [float(re.search(r"lm_loss: ([0-9.E+-]+)", ln).group(1)) for ln in lines]
    assert losses[-1] < losses[0] - 0.3, losses
    assert re.search(r"validation results at iteration 15 \| lm_loss value", out)
    assert re.search(r"test results at iteration 30 \| lm_loss value", out)

    stdout_files = sorted((run / "logs").glob("*_stdout.txt"))  # log_dir tees every rank's output
    assert len(stdout_files) == 2 and any("training finished" in f.read_text() for f in stdout_files)

    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step30"
    step = ckpt / "global_step30"
    names = {p.name for p in step.iterdir()}
    expected = {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert expected | {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "configs", "manifest.json"} <= names
    assert (step / "configs" / "tiny_e2e.yml").read_text() == config_file.read_text()
    resolved = json.loads((step / "configs" / "resolved_config.json").read_text())
    assert resolved["train_iters"] == 30 and resolved["padded_vocab_size"] == 512

    tb = tensorboard_scalars(run / "tb")
    assert [s for s, _ in tb["train/lm_loss"]] == list(range(1, 31))
    assert tb["train/lm_loss"][-1][1] < tb["train/lm_loss"][0][1]
    assert {"train/learning_rate", "train/grad_norm", "train/param_norm", "validation/lm_loss"} <= set(tb)
    assert {"runtime/samples_per_sec", "runtime/model_flops_utilization", "timers/forward"} <= set(tb)
    # GPT-NeoX's timers: seconds per iteration, written every iteration
    assert [s for s, _ in tb["timers/forward"]] == list(range(1, 31))
    assert all(0 < v < 30 for _, v in tb["timers/forward"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    assert "neox_args/text_summary" in ea.Tags()["tensors"]  # the resolved config as TensorBoard text
    (wandb_file,) = find_run_files(run / "logs")
    rows = read_wandb_history(wandb_file)
    logged = [r for r in rows if "train/lm_loss" in r]
    assert [r["_step"] for r in logged] == list(range(1, 31))
    assert logged[-1]["train/lm_loss"] == pytest.approx(tb["train/lm_loss"][-1][1], rel=1e-6)
    assert any("validation/lm_loss_ppl" in r for r in rows)

    # generate.py from the checkpoint (greedy): GPT-NeoX's JSONL records
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\nimport os\n")
    samples = tmp_path / "samples.jsonl"
    gen = [PYTHON, "deepy.py", "generate.py", str(config_file), "--text_gen_type", "input-file"]
    gen += ["--sample_input_file", str(prompts), "--sample_output_file", str(samples), "--maximum_tokens", "8"]
    run_command(gen, timeout=300)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["context"] for r in records] == ["def main():", "import os"]
    assert all(0 < r["length"] <= 8 or r["finished"] for r in records)
    assert set(records[0]) >= {"context", "text", "length", "finished", "message", "duration_seconds"}


def test_deepy_train_reports_bad_data_path_and_exits_nonzero(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    cfg = tiny_config(data, world=1, master_port=free_port())
    cfg["data_path"] = str(tmp_path / "missing" / "nothing_text_document")
    cfg.pop("global_num_gpus")
    cfg["num_gpus"] = 1
    config_file = tmp_path / "bad.yml"
    config_file.write_text(yaml.safe_dump(cfg))
    result = run_command([PYTHON, "deepy.py", "train.py", str(config_file)], timeout=300, check=False)
    assert result.returncode != 0
    assert "error:" in result.stderr and "nothing_text_document" in result.stderr
    assert "Traceback" not in result.stderr
