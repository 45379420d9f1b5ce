"""``deepy.py --autotune``'s pieces without launches (trial configs, step log, bad flags) and DeepSpeed's autotuner's
wiring: the ``autotuning`` block, the runner's arguments, an experiment's DeepSpeed config on the ranks."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from megatron.launcher.autotune import Trial, autotune_main, format_table, layout_values, step_times, trial_values
from megatron.launcher.config import LauncherConfig
from megatron.launcher.launch import plan_launch, write_run_dir
from megatron.logging.metrics import format_console_line
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.autotuning import autotuning_overrides, with_experiment
from megatron.planner.search import Candidate

BASE = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
    "train_micro_batch_size_per_gpu": 4, "num_gpus": 2, "zero_optimization": {"stage": 0, "overlap_comm": False},
    "tokenizer_type": "CharLevelTokenizer", "train_iters": 100, "save": "ckpts", "load": "ckpts", "checkpoint_factor": 50,
}  # fmt: skip


def _candidate(**kw: object) -> Candidate:
    fields = {"tp": 2, "pp": 0, "dp": 1, "zero_stage": 1, "micro_batch": 2, "gas": 4, "checkpoint_activations": True}
    fields.update(kw)
    return Candidate(**fields, upper_bound_tokens_per_s=1.0, predicted=None, memory_bytes=1, reason=None)  # type: ignore[arg-type]


def test_layout_config_keeps_the_global_batch_and_loads() -> None:
    values = layout_values(BASE, _candidate())
    args = NeoXArgs.from_dict(values)
    assert (args.model_parallel_size, args.zero_stage, args.checkpoint_activations) == (2, 1, True)
    assert (args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps, args.train_batch_size) == (2, 4, 8)
    assert args.zero_optimization["overlap_comm"] is False  # the user's other ZeRO settings are kept
    assert (args.save, args.train_iters) == ("ckpts", 100)


def test_trial_config_measures_without_checkpoints_or_evaluation() -> None:
    args = NeoXArgs.from_dict(trial_values(BASE, _candidate(), 7, "trial-1"))
    assert (args.train_iters, args.log_interval, args.save, args.load, args.eval_iters) == (7, 1, None, None, 0)
    assert args.log_dir == "trial-1"


def test_step_times_read_the_training_log_line() -> None:
    lines = [
        format_console_line(i, 4, {"runtime/iteration_time": 0.25 * i, "runtime/tokens_per_sec": 10.0}, {}, {})
        for i in range(1, 5)
    ]
    assert step_times("\n".join(["noise", *lines]), skip=2) == pytest.approx([0.75, 1.0])


def test_table_shows_measured_over_predicted_and_failures() -> None:
    ok = Trial(_candidate(), "t1", 0, [0.2, 0.4, 0.3])
    failed = Trial(_candidate(tp=1, dp=2), "t2", 1, None, "exit status 1: boom")
    table = format_table([ok, failed]).splitlines()
    assert table[1].split()[:10] == ["1", "2", "0", "1", "1", "2", "4", "yes", "-", "0.3000"]
    assert table[2].endswith("exit status 1: boom")


@pytest.mark.parametrize(("flag", "value"), [("--candidates", "0"), ("--steps", "two"), ("--trial-seconds", "-1")])
def test_bad_autotune_flags_are_one_error_naming_the_flag(flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{flag} '{value}': must be"):
        autotune_main(["--autotune", flag, value, "train.py", "x.yml"])


AUTOTUNING = {"enabled": True, "fast": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}}


def test_autotuning_block_reaches_deepspeed_only_under_the_autotuner(caplog: pytest.LogCaptureFixture) -> None:
    plain = NeoXArgs.from_dict({**BASE, "autotuning": AUTOTUNING})
    assert "autotuning" not in plain.deepspeed_config  # DeepSpeed's engine would end a normal run after 5 steps
    assert "autotuning is ignored: DeepSpeed's autotuner reads it under deepy.py --autotuning" in caplog.text
    tuned = NeoXArgs.from_dict({**BASE, "autotuning": AUTOTUNING, "autotuning_run": "tune"})
    assert tuned.deepspeed_config["autotuning"] == AUTOTUNING
    search = {**BASE, "autotuning": AUTOTUNING, "zero_optimization": {"stage": [0, 1, 2, 3]}}
    with pytest.raises(ConfigError, match=r"stage=\[0, 1, 2, 3\]: expected 0, 1, 2 or 3 \(a list or 'all' is"):
        NeoXArgs.from_dict(search)
    assert NeoXArgs.from_dict({**search, "autotuning_run": "tune"}).zero_optimization["stage"] == [0, 1, 2, 3]


def test_autotuning_launch_gives_the_runner_the_mode_and_the_ranks_the_deepspeed_config(tmp_path: Path) -> None:
    args = NeoXArgs.from_dict({**BASE, "autotuning": AUTOTUNING, "autotuning_run": "run", "user_script": "train.py"})
    plan = plan_launch(LauncherConfig.from_neox_args(args), str(tmp_path), on_cpu=True)
    argv = plan.runner_argv
    assert argv[argv.index("--autotuning") + 1] == "run" and argv.index("--autotuning") < argv.index("train.py")
    assert argv[argv.index("--deepspeed_config") + 1] == str(tmp_path.resolve() / "ds_config.json")
    assert plan.env["LOCAL_SIZE"] == "2"  # DeepSpeed's CPU accelerator: one device per rank, not per NUMA node
    write_run_dir(args, plan)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert "train_batch_size" not in ds and "gradient_accumulation_steps" not in ds and ds["autotuning"] == AUTOTUNING
    plain = plan_launch(LauncherConfig.from_neox_args(NeoXArgs.from_dict({**BASE, "user_script": "train.py"})), "x")
    assert "--autotuning" not in plain.runner_argv and "--deepspeed_config" not in plain.runner_argv


def test_an_experiments_deepspeed_config_sets_the_tuned_keys(tmp_path: Path) -> None:
    resolved = NeoXArgs.from_dict(BASE).to_dict()  # what deepy writes as --neox_config
    experiment = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_batch_size": 4,
                  "zero_optimization": {"stage": 1}, "autotuning": AUTOTUNING, "optimizer": {"type": "ignored"}}  # fmt: skip
    encoded = base64.urlsafe_b64encode(json.dumps(experiment).encode()).decode()
    (tmp_path / "ds.json").write_text(json.dumps(experiment))
    for given in (encoded, str(tmp_path / "ds.json")):  # as DeepSpeed's autotuner passes it, or a file
        tuned = autotuning_overrides(given)
        assert set(tuned) == {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                              "zero_optimization", "autotuning"}  # fmt: skip
        args = NeoXArgs.from_dict(with_experiment(resolved, tuned))
        assert (args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps, args.zero_stage) == (1, 2, 1)
    with pytest.raises(ConfigError, match="--deepspeed_config not-base64!: neither a JSON file nor base64"):
        autotuning_overrides("not-base64!")
