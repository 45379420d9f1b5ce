"""Hostile config inputs through the commands a user runs: ``deepy.py train.py`` refuses them before launching
(exit 2, one ``deepy.py: error:`` line naming the key and the file, no traceback, no run folder), and ``train.py``
started by torchrun — which reads the YAML itself, without deepy — refuses them before the rank builds a model
(exit 1, one ``error:`` line, no checkpoint). Without these checks the torchrun run with ``lr: .inf`` inside
``optimizer.params`` trains, exits 0 and saves NaN weights."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import deepy
from megatron.neox_arguments.loader import parse_config_text
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import REPO_ROOT, free_port, run_command
from tests.unit.test_config_hostile_inputs import billion_laughs

TINY = str(REPO_ROOT / "configs" / "cpu" / "tiny.yml")
DIGITS = "1" * 50_000


def _adam(lr: float) -> dict[str, Any]:
    return {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1.0e-8}}


def _deepy(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert deepy.main(["train.py", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("deepy.py: error: ") and err.count("\n") == 1 and "Traceback" not in out + err, err
    return err.removeprefix("deepy.py: error: ").rstrip("\n")


# file name -> (text, the whole message after the file's path, or a fragment)
FILES: dict[str, tuple[str, str]] = {
    "inf_lr.yml": ("optimizer: {type: Adam, params: {lr: .inf}}\n", "optimizer.params.lr=inf must be a finite number"),
    "nan_lr.yml": ("optimizer: {type: Adam, params: {lr: .nan}}\n", "optimizer.params.lr=nan must be a finite number"),
    "digits.yml": (f"seed: {DIGITS}\n", "line 1: key 'seed': an integer of 50000 digits is too long"),
    "digits.json": (f'{{"seed": {DIGITS}}}', "key 'seed': an integer of 50000 digits is too long"),
    "twice.json": ('{"seed": 1, "seed": 2}', "key 'seed' is given twice in one object"),
    "weights.yml": (
        "train_data_paths: [a, b]\nvalid_data_paths: [a, b]\ntest_data_paths: [a, b]\n"
        "train_data_weights: [1e308, 1e308]\n",
        "train_data_weights=[1e+308, 1e+308]: weights must be finite and their sum must be finite",
    ),
    "huge.yml": ("hidden_size: 2147483648\n", "more than PyTorch can index"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_deepy_refuses_before_launch(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text, expected = FILES[name]
    path = tmp_path / name
    path.write_text(text)
    base = tmp_path / "base.yml"  # tiny.yml without the keys the hostile file sets (a key may be set in one file)
    tiny = parse_config_text(Path(TINY).read_text(), TINY)
    base.write_text(yaml.safe_dump({k: v for k, v in tiny.items() if k not in ("optimizer", "hidden_size", "seed")}))
    run_dir = tmp_path / "run"
    msg = _deepy([str(base), str(path), "--run_dir", str(run_dir)], capsys)  # a real launch, were it valid
    assert expected in msg and str(path) in msg, msg
    assert not run_dir.exists()


def test_deepy_refuses_a_fifty_thousand_digit_override(capsys: pytest.CaptureFixture) -> None:
    msg = _deepy([TINY, "--seed", DIGITS, "--dry-run"], capsys)
    assert msg == "--seed on the command line: line 1: an integer of 50000 digits is too long (the limit is 4300)"


def test_deepy_refuses_a_directory_as_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "setup.yml"
    folder.mkdir()
    assert _deepy([TINY, str(folder), "--dry-run"], capsys) == f"{folder} is a directory, not a config file"


@pytest.mark.timeout(20)
def test_deepy_dry_run_refuses_a_billion_laughs_promptly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bomb = tmp_path / "bomb.yml"
    bomb.write_text(billion_laughs())
    start = time.monotonic()
    msg = _deepy([TINY, str(bomb), "--dry-run"], capsys)
    assert time.monotonic() - start < 5
    assert msg.startswith(f"{bomb}: line 8: key 'deepspeed_extra_args.g': the value expands to more than 1,000,000")


def test_deepy_refuses_a_model_beyond_this_machine_before_launch(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    msg = _deepy([TINY, "--hidden_size", "1048576", "--run_dir", str(run_dir)], capsys)
    assert msg.startswith(f"model too large: num_layers=2, hidden_size=1048576 (set in {TINY}, the overrides) give")
    assert "GiB of CPU memory" in msg and not run_dir.exists()


# ---------------------------------------------------------------- train.py under torchrun, no deepy


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("hostile") / "data")


CASES = {
    "inf_lr": ({"optimizer": _adam(float("inf"))}, "error: optimizer.params.lr=inf must be a finite number (set in"),
    "nan_lr": ({"optimizer": _adam(float("nan"))}, "error: optimizer.params.lr=nan must be a finite number (set in"),
    "huge_model": ({"hidden_size": 2**20}, "error: model too large: num_layers=2, hidden_size=1048576 (set in"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchrun_train_refuses_before_building_the_model(case: str, data: dict[str, str], tmp_path: Path) -> None:
    overrides, expected = CASES[case]
    save = tmp_path / "checkpoints"
    cfg = tiny_config(data, world=1, train_iters=2, save=str(save), checkpoint_factor=1, **overrides)
    cfg.pop("global_num_gpus")  # resolved from torchrun's WORLD_SIZE, as a user's config would be
    config = tmp_path / "cfg.yml"
    config.write_text(yaml.safe_dump(cfg))  # PyYAML writes .inf / .nan
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    cmd = [torchrun, "--nproc_per_node", "1", "--master_port", str(free_port()), "train.py", str(config)]
    res = run_command(cmd, timeout=300, check=False)
    assert res.returncode != 0, res.describe()
    rank_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(rank_lines) == 1 and rank_lines[0].startswith(expected), res.describe()
    assert str(config) in rank_lines[0] and "training failed" not in res.stdout + res.stderr
    assert not save.exists()
