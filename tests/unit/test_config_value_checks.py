"""Every config key is checked before launch: a table-driven walk over the whole schema gives each key a bad value
of its kind (derived from its type and its range) and expects one ConfigError naming the key.

A new key is covered automatically: numeric keys need a range in ``ranges.RANGES``, string/list/dict keys a
syntax example in ``STRUCTURED`` below, or an entry in ``NO_BAD_VALUE`` with the reason no value of the right
kind is wrong.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.neox_args import HINTS
from megatron.neox_arguments.ranges import NO_RANGE, RANGES, Range
from megatron.neox_arguments.value_checks import DATA_PATH_LISTS
from tests.unit.test_neox_args import CPU1, TINY

# Structured strings, lists and dicts: (a value of the right type with the wrong syntax or content, a fragment the
# message must hold besides the key).
STRUCTURED: dict[str, tuple[Any, str]] = {
    "pipe_partition_method": ("type:transformer(", "invalid regular expression"),
    "attention_config": ([["global", 2]], "[[types...], repeat] pair"),
    "sparsity_config": ({"block": 0}, "sparsity_config.block=0 must be an integer >= 1"),
    "param_sharing_style": ("zigzag", "must be one of"),
    "recompute_granularity": ("full", "must be one of"),
    "soft_prompt_tuning": ({"enabled": True, "n_tokens": 0}, "n_tokens=0 must be an integer >= 1"),
    "te_fp8_amax_compute_algo": ("median", "not supported yet"),
    **dict.fromkeys(DATA_PATH_LISTS, (["data/a_text_document", 3], "entry 3 is not a non-empty string")),
    **dict.fromkeys(
        ("train_data_weights", "valid_data_weights", "test_data_weights"), ([1.0, -0.5], "entry -0.5 is not")
    ),
    "online_dataserver_ips": (["10.0.0.1", ""], "entry '' is not"),
    "extra_save_iters": ([10, -1], "entry -1 is not an iteration"),
    "split": ("969,30,1,1", "more than three parts"),
    "preemption_signals": (["SIGFOO"], "SIGFOO"),
    "wandb_host": ("api.wandb.ai", "must be a URL"),
    "prompt_end": ("", "must not be empty"),
    "comet_tags": (["tag", 3], "entry 3 is not"),
    "eval_tasks": (["lambada_openai", 3], "entry 3 is not"),
    "optimizer": ({"type": "adam", "params": "fast"}, "'params' must be a mapping"),
    "fp16": ({"enabled": "yes"}, "fp16.enabled='yes' must be true or false"),
    "bf16": ({"enable": True}, "must contain 'enabled'"),  # misspelt: DeepSpeed would quietly train in fp32
    "amp": ({"opt_level": "O1"}, "must contain 'enabled'"),
    "zero_optimization": ({"stage": 4}, "zero_optimization.stage=4 must be 0, 1, 2 or 3"),
    "scheduler": ({"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}, "must be an integer >= 0"),
    "activation_checkpointing": ({"partition_activations": "no"}, "must be true or false"),
    "flops_profiler": ({"profile_step": 1}, "must contain 'enabled'"),
    "communication_data_type": ("fp8", "must be one of"),
    "include": ("worker-0:a", "bad slot list"),
    "exclude": ("worker-0@", "empty NODE"),
    "autotuning_run": ("fly", "expected one of 'tune', 'run'"),
    "distributed_backend": ("carrier-pigeon", "must be one of"),
    "s3_path": ("gs://bucket/runs", "is not an S3 location: it does not start with s3://"),
    "curriculum_learning": ({"enabled": True, "min_difficulty": 8}, "curriculum_learning.max_difficulty=None must be"),
}

PATH = "a path or path prefix: whether it exists is checked where it is opened, with an error naming it"
FREE = "free text (a name, tag, prefix or separator): any string is valid"
PASS = "a DeepSpeed config block handed to DeepSpeed unchanged: DeepSpeed validates its content"
SET = "set by the launcher or the loader, not by users"
NO_BAD_VALUE: dict[str, str] = {
    **dict.fromkeys(("data_path", "save", "load", "vocab_file", "merge_file", "base_shapes_file", "log_dir"), PATH),
    **dict.fromkeys(("tensorboard_dir", "memory_profiling_path", "sample_input_file", "sample_output_file"), PATH),
    **dict.fromkeys(("hostfile", "fused_kernels_build_path", "deepscale_config", "user_script"), PATH),
    "s3_cache_dir": PATH,
    **dict.fromkeys(("wandb_group", "wandb_run_name", "wandb_team", "wandb_project", "comet_workspace"), FREE),
    **dict.fromkeys(("comet_project", "comet_experiment_name", "precompute_model_name"), FREE),
    "comet_experiment": FREE,
    **dict.fromkeys(("eval_results_prefix", "comment", "account", "master_addr"), FREE),
    "comet_others": "free metadata handed to Comet unchanged",
    **dict.fromkeys(("autotuning", "sparse_attention", "data_efficiency"), PASS),
    **dict.fromkeys(("tensorboard", "wandb", "csv_monitor", "elasticity", "comms_logger"), PASS),
    **dict.fromkeys(("compression_training", "checkpoint", "data_types", "deepspeed_extra_args"), PASS),
    **dict.fromkeys(("git_hash", "config_files"), SET),
}


def _members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _out_of_range(rng: Range, integer: bool) -> float:
    """A number just outside ``rng`` (of the key's number type)."""
    step = 1 if integer else 0.5
    for candidate in ([rng.lo - step, rng.lo] if rng.lo is not None else []) + (
        [rng.hi + step, rng.hi] if rng.hi is not None else []
    ):
        if not rng.contains(candidate):
            return int(candidate) if integer else float(candidate)
    raise AssertionError(f"no value outside {rng}")


def bad_values(key: str) -> list[tuple[Any, str]]:
    """(bad value of the key's kind, a fragment its message holds); empty when the key is allow-listed."""
    tp = HINTS[key]
    members = _members(tp)
    literal = [m for m in members if typing.get_origin(m) is Literal]
    out: list[tuple[Any, str]] = []
    if literal:
        out.append(("no-such-choice", "expected one of"))
    if bool in members:
        out.append(("maybe", "expected bool"))
    numeric = int in members or float in members
    if numeric and key in RANGES:
        rng = RANGES[key]
        out.append((_out_of_range(rng, integer=float not in members), f"must be {rng.describe()}"))
        if float in members:
            out.append((math.nan, f"must be {rng.describe()}"))
    if key in STRUCTURED:
        out.append(STRUCTURED[key])
    return out


def _error(key: str, value: Any) -> str:
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, key: value}, env=CPU1)
    return str(e.value)


def test_every_key_is_checked_or_allow_listed() -> None:
    uncovered = []
    for key, tp in HINTS.items():
        members = _members(tp)
        numeric = int in members or float in members
        if numeric and key not in RANGES and key not in NO_RANGE:
            uncovered.append(f"{key}: numeric, add a range to megatron/neox_arguments/ranges.py")
        text = str in members or list in members or dict in members
        if text and not numeric and key not in STRUCTURED and key not in NO_BAD_VALUE:
            uncovered.append(f"{key}: add a syntax check and an example to STRUCTURED, or a reason to NO_BAD_VALUE")
    assert not uncovered, "\n".join(uncovered)
    assert not set(NO_BAD_VALUE) & set(STRUCTURED)


@pytest.mark.parametrize("key", sorted(HINTS))
def test_bad_value_of_its_kind_names_the_key(key: str) -> None:
    for value, fragment in bad_values(key):
        message = _error(key, value)
        assert key in message and fragment in message, f"{key}={value!r}: {message}"


def test_defaults_are_in_range_and_messages_are_readable() -> None:
    from megatron.neox_arguments.namespace import default_values

    defaults = default_values()
    for key, rng in RANGES.items():
        value = defaults[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert rng.contains(float(value)), key
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, "top_p": 1.5, "num_nodes": 0, "lr": float("inf"), "hidden_dropout": 1.0}, env=CPU1)
    assert e.value.problems == [
        "top_p=1.5 must be between 0 and 1",
        "num_nodes=0 must be -1 or >= 1",
        "lr=inf must be >= 0 and finite",
        "hidden_dropout=1.0 must be in [0, 1)",
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"checkpoint_factor": 2.5, "save": "x"}, "checkpoint_factor=2.5 must be a whole number"),
        ({"profile": True, "profile_step_start": 5, "profile_step_stop": 3}, "profile_step_stop=3 is before"),
        ({"loss_spike_skip_window": 1}, "loss_spike_skip_window=1 must be 0 or >= 2"),
        # an OverflowError in datetime.timedelta, and a 0 ms socket timeout, without the range
        (
            {"distributed_timeout_minutes": 1e15},
            "distributed_timeout_minutes=1000000000000000.0 must be between 0.001 and 10080",
        ),
        ({"distributed_timeout_minutes": 1e-9}, "distributed_timeout_minutes=1e-09 must be between 0.001 and 10080"),
        (
            {"train_iters": 0, "extra_save_iters": [5], "save": "x"},
            "extra_save_iters [5] lie beyond train_iters=0: the run never reaches them",
        ),
        (
            {"train_iters": 10, "extra_save_iters": [0, 10, 11, 40], "save": "x"},
            "extra_save_iters [11, 40] lie beyond train_iters=10",
        ),
    ],
)
def test_impossible_combinations_are_refused(overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, **overrides}, env=CPU1)
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_extra_save_iters_up_to_train_iters_pass() -> None:
    args = NeoXArgs({**TINY, "train_iters": 10, "extra_save_iters": [0, 10], "save": "x"}, env=CPU1)
    assert args.extra_save_iters == [0, 10]
