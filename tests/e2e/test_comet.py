"""Comet logging (``use_comet``) through the real ``comet_ml`` package in its offline mode, read back from the archive
it writes: GPT-NeoX's ``local_setup_comet.yml`` trains with the metrics TensorBoard and the console get, its name,
tags, project and others; the API key in the environment reaches no file. The sink alone, rank 0 only, and the
one-line errors: ``tests/unit/test_comet.py``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.comet_archive import archive_contains, read_offline_archive
from tests.distributed.fns_train import deepy_train, make_tiny_data, tensorboard_scalars, tiny_config
from tests.e2e.shrink import load_raw
from tests.harness import free_port
from tests.shared_files import SHARED

REF = SHARED / "reference" / "gpt-neox-configs"
FAKE_KEY = "fake-comet-key-5ecret-0123456789abcdef"  # must reach no file, log line or command line
# the shipped file's paths (GPT-NeoX's machine) are replaced by the test's own
PATH_KEYS = ("data_path", "vocab_file", "merge_file", "save", "load", "tensorboard_dir", "log_dir")


@pytest.mark.skipif(not (REF / "local_setup_comet.yml").is_file(), reason="GPT-NeoX reference configs not present")
def test_local_setup_comet_trains_offline_with_the_tensorboard_metrics(tmp_path: Path) -> None:
    setup = load_raw([REF / "local_setup_comet.yml"])
    assert setup["use_comet"] is True and setup["comet_tags"] == ["test_tag1", "test_tag2"]
    run = tmp_path / "run"
    data = make_tiny_data(tmp_path / "data")
    cfg = tiny_config(
        data,
        world=1,
        train_iters=2,
        log_interval=1,
        eval_interval=2,
        eval_iters=1,
        master_port=free_port(),
        **{k: v for k, v in setup.items() if k not in PATH_KEYS},
        save=str(run / "ckpt"),
        load=str(run / "ckpt"),
        checkpoint_factor=2,
        tensorboard_dir=str(run / "tb"),
        log_dir=str(run / "logs"),
    )
    env = {"COMET_START_ONLINE": "false", "COMET_OFFLINE_DIRECTORY": str(run / "comet"), "COMET_API_KEY": FAKE_KEY}
    out = deepy_train(cfg, tmp_path / "comet.yml", world=1, env=env)
    assert "training finished at iteration 2" in out

    (archive,) = (run / "comet").glob("*.zip")
    comet = read_offline_archive(archive)
    experiment = comet["experiment"]
    assert experiment["project_name"] == "test_project" and experiment["workspace"] is None  # commented out there
    assert sorted(experiment["tags"]) == ["test_tag1", "test_tag2"]
    assert comet["others"]["Name"] == "test_experiment"
    assert "test_others" in comet["others"]  # GPT-NeoX's `{"test_others"}`: a key without a value
    assert comet["parameters"]["hidden_size"] == 64 and comet["parameters"]["use_comet"] is True
    assert comet["parameters"]["optimizer|type"] == "Adam"  # nested values flattened, as GPT-NeoX logs them
    assert comet["parameters"]["comet_tags"] == ["test_tag1", "test_tag2"]

    # every scalar TensorBoard got, at the same steps with the same values (TensorBoard keeps float32)
    tb = tensorboard_scalars(run / "tb")
    assert {"train/lm_loss", "train/learning_rate", "validation/lm_loss", "runtime/tokens_per_sec"} <= set(tb)
    for tag, events in tb.items():
        logged = [(step, np.float32(value)) for step, value in comet["metrics"].get(tag, [])]
        assert logged == [(step, np.float32(value)) for step, value in events], tag
    assert [step for step, _ in comet["metrics"]["train/lm_loss"]] == [1, 2]

    # and what the console printed at those steps
    lines = [ln for ln in out.splitlines() if re.match(r"^iteration\s+\d+/\s+2 \|", ln)]
    assert len(lines) == 2
    for line, (step, loss), (_, lr) in zip(
        lines, comet["metrics"]["train/lm_loss"], comet["metrics"]["train/learning_rate"], strict=True
    ):
        assert f"iteration {step:8d}/" in line
        assert float(re.search(r"lm_loss: ([0-9.E+-]+)", line).group(1)) == pytest.approx(loss, rel=1e-6)
        assert float(re.search(r"learning rate: ([0-9.E+-]+)", line).group(1)) == pytest.approx(lr, rel=1e-3)

    # the API key in the environment reached no file of the run (run folder, logs, checkpoints, archive) or output
    assert FAKE_KEY not in out
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path
    assert not archive_contains(archive, FAKE_KEY.encode())
