"""``deepy.py --autotune``'s pieces without launches: the trial configs load, the step log parses, bad flags."""

from __future__ import annotations

import pytest

from megatron.launcher.autotune import Trial, autotune_main, format_table, layout_values, step_times, trial_values
from megatron.logging.metrics import format_console_line
from megatron.neox_arguments import ConfigError, NeoXArgs
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
