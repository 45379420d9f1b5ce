"""Hostile config inputs get one clear ConfigError naming the key path and the file, from the loader and NeoXArgs:
numbers inside dict-valued keys (non-finite, out of range), integers too long to convert or beyond 64 bits, keys
repeated inside one JSON object, YAML alias bombs and recursive aliases, deep nesting, weights whose sum
overflows, a directory given as a config file. The deepy/torchrun side: tests/e2e/test_bad_config_inputs.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.loader import merge_config_files, parse_config_text
from megatron.neox_arguments.neox_args import KNOWN_KEYS
from megatron.neox_arguments.parse_guards import MAX_VALUES
from tests.unit.test_neox_args import CPU1, TINY, problems, write

ADAM = {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8}}


def billion_laughs(key: str = "deepspeed_extra_args") -> str:
    """The classic: nine levels of nine aliases each, 9**9 strings once expanded."""
    lines = [f"{key}:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"  {name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _error(tmp_path: Path, name: str, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls([write(tmp_path, name, text)])
    return str(e.value)


# ---------------------------------------------------------------- numbers inside dict-valued keys


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"optimizer": {**ADAM, "params": {"lr": float("inf")}}}, "optimizer.params.lr=inf must be a finite number"),
        ({"optimizer": {**ADAM, "params": {"lr": float("nan")}}}, "optimizer.params.lr=nan must be a finite number"),
        ({"optimizer": {**ADAM, "params": {"lr": -0.1}}}, "optimizer.params.lr=-0.1 must be >= 0"),
        ({"optimizer": {**ADAM, "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas[1]=1.5 must be in [0, 1)"),
        ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size=0"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("-inf")}}}, "warmup_max_lr=-inf"),
        ({"deepspeed_extra_args": {"x": {"y": [1.0, float("nan")]}}}, "deepspeed_extra_args.x.y[1]=nan must be a"),
        ({"deepspeed_extra_args": {"gradient_clipping": -1.0}}, "deepspeed_extra_args.gradient_clipping=-1.0 must"),
        ({"deepspeed_extra_args": {"optimizer": {"params": {"lr": 1e400}}}}, "optimizer.params.lr=inf"),
    ],
)
def test_numbers_inside_dict_values_are_checked(overrides: dict, fragment: str) -> None:
    assert any(fragment in p for p in problems(**overrides)), problems(**overrides)


def test_learning_rate_given_as_a_string_is_checked_after_conversion() -> None:
    assert problems(optimizer={**ADAM, "params": {"lr": "inf"}}) == [
        "optimizer.params.lr='inf' must be a finite number >= 0"
    ]


def test_nested_problem_names_the_file(tmp_path: Path) -> None:
    text = "optimizer: {type: Adam, params: {lr: .inf}}\n"
    msg = _error(tmp_path, "a.yml", "".join(f"{k}: {v}\n" for k, v in TINY.items()) + text)
    assert msg == f"optimizer.params.lr=inf must be a finite number (set in {tmp_path / 'a.yml'})"


def test_top_level_non_finite_says_finite() -> None:
    assert problems(lr=float("nan")) == ["lr=nan must be >= 0 and finite"]


def test_finite_nested_values_pass() -> None:
    args = NeoXArgs({**TINY, "optimizer": ADAM, "deepspeed_extra_args": {"a": {"b": 1e30}}}, env=CPU1)
    assert args.lr == 0.001


# ---------------------------------------------------------------- integers


def test_fifty_thousand_digit_integer_in_yaml_json_and_on_the_command_line(tmp_path: Path) -> None:
    digits = "1" * 50_000
    yml = _error(tmp_path, "a.yml", f"seed: {digits}\n")
    assert (
        yml == f"{tmp_path / 'a.yml'}: line 1: key 'seed': an integer of 50000 digits is too long (the limit is 4300)"
    )
    nested = _error(tmp_path, "b.json", json.dumps({"optimizer": {"params": {"lr": 1}}}).replace("1}", f"{digits}}}"))
    assert nested.endswith(
        "b.json: key 'optimizer.params.lr': an integer of 50000 digits is too long (the limit is 4300)"
    )
    with pytest.raises(ConfigError) as e:
        parse_deepy_args(["train.py", "configs/cpu/tiny.yml", "--seed", digits])
    assert (
        str(e.value) == "--seed on the command line: line 1: an integer of 50000 digits is too long (the limit is 4300)"
    )
    quoted = _error(tmp_path, "c.yml", f"seed: '{digits}'\n")  # a string that looks like a number: cut in the message
    assert "(50000 characters)" in quoted and len(quoted) < 400


def test_integers_beyond_64_bits_are_refused_without_printing_them(tmp_path: Path) -> None:
    # hexadecimal converts without Python's digit limit: the value reaches NeoXArgs, which cannot even repr it
    msg = _error(tmp_path, "a.yml", "deepspeed_extra_args: {x: 0x" + "f" * 4000 + "}\n")
    assert msg.startswith("deepspeed_extra_args.x=<an integer of about 4816 digits> is too large: integers must fit")
    assert problems(train_iters=2**63) == [
        f"train_iters=<an integer of about 19 digits> is too large: integers must fit in 64 bits (at most {2**63 - 1})"
    ]


def test_hidden_size_beyond_what_pytorch_indexes(tmp_path: Path) -> None:
    assert problems(hidden_size=2**31, num_attention_heads=1) == [
        "model too large: num_layers=2, hidden_size=2147483648 give at least 1.11e+20 parameters, more than PyTorch "
        "can index (2**63-1)"
    ]


# ---------------------------------------------------------------- JSON keys given twice


def test_json_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "a.json", '{"seed": 1, "optimizer": {"params": {"lr": 1, "lr": 2}}, "seed": 2}')
    with pytest.raises(ConfigError) as e:
        merge_config_files([path], KNOWN_KEYS)
    assert e.value.problems == [
        f"{path}: key 'seed' is given twice in one object; keep one (the last would silently win)",
        f"{path}: key 'optimizer.params.lr' is given twice in one object; keep one (the last would silently win)",
    ]
    with pytest.raises(ConfigError, match="keys 'train-iters' and 'train_iters' are the same key"):
        parse_config_text('{"train-iters": 1, "train_iters": 2}', "b.json")
    assert parse_config_text('{"fp16": {"enabled": true}, "bf16": {"enabled": false}}', "c.json")["bf16"] == {
        "enabled": False
    }


def test_resolved_json_from_the_worker_command_line_is_checked_too(tmp_path: Path) -> None:
    path = write(tmp_path, "neox_config.json", '{"seed": 1, "seed": 2}')
    with pytest.raises(ConfigError, match=r"--neox_config .*neox_config.json: key 'seed' is given twice"):
        NeoXArgs.consume_neox_args(input_args=["--neox_config", path])
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        NeoXArgs.consume_neox_args(input_args=["--neox_config", str(tmp_path)])


# ---------------------------------------------------------------- YAML aliases and nesting


def test_billion_laughs_is_refused_fast(tmp_path: Path) -> None:
    start = time.monotonic()
    msg = _error(tmp_path, "bomb.yml", billion_laughs())
    assert time.monotonic() - start < 2
    assert msg == (
        f"{tmp_path / 'bomb.yml'}: line 8: key 'deepspeed_extra_args.g': the value expands to more than "
        f"{MAX_VALUES:,} values through aliases (*name); write the values out instead"
    )


def test_ordinary_aliases_still_work(tmp_path: Path) -> None:
    text = "".join(f"{k}: {v}\n" for k, v in TINY.items())
    text += "optimizer: &opt {type: Adam, params: {lr: 0.002}}\ndeepspeed_extra_args: {copy: *opt}\n"
    args = NeoXArgs.from_ymls([write(tmp_path, "a.yml", text)])
    assert args.deepspeed_extra_args == {"copy": {"type": "Adam", "params": {"lr": 0.002}}}


def test_recursive_alias_and_deep_nesting(tmp_path: Path) -> None:
    msg = _error(tmp_path, "rec.yml", "deepspeed_extra_args: &a {x: *a}\n")
    assert msg.endswith("rec.yml: line 1: an alias refers to a value that contains it (a recursive alias)")
    deep = _error(tmp_path, "deep.yml", "deepspeed_extra_args: " + "[" * 5000 + "]" * 5000 + "\n")
    assert deep.startswith(f"{tmp_path / 'deep.yml'}: nested more deeply than")
    deep_json = _error(tmp_path, "deep.json", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert deep_json.startswith(f"{tmp_path / 'deep.json'}: nested more deeply than")


# ---------------------------------------------------------------- weights, directories


@pytest.mark.parametrize("weights", [[1e308, 1e308], [1.7e308, 1.7e308, 1.0]])
def test_weights_whose_sum_overflows(weights: list[float]) -> None:
    paths = {f"{s}_data_paths": ["a", "b", "c"][: len(weights)] for s in ("train", "valid", "test")}
    (problem,) = problems(**paths, train_data_weights=weights)
    assert problem == (
        f"train_data_weights={weights!r}: weights must be finite and their sum must be finite; scale them down "
        "(only their ratios matter)"
    )


def test_directory_as_config_file(tmp_path: Path) -> None:
    folder = tmp_path / "cfg.yml"
    folder.mkdir()
    with pytest.raises(ConfigError) as e:
        merge_config_files([str(folder)], KNOWN_KEYS)
    assert str(e.value) == f"{folder} is a directory, not a config file"


def test_fifty_thousand_digit_iteration_option(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        parse_deepy_args(["train.py", "configs/cpu/tiny.yml", "--iteration", "1" * 50_000])
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and err == (
        "deepy.py: error: argument --iteration: expected a checkpoint iteration (an integer), got "
        "'11111111111111111111... (50000 characters)'"
    )
