"""The Comet sink in this process through the real ``comet_ml`` (offline archive read back), and the one-line errors
where Comet cannot start: no package, no API key online, a setting comet_ml cannot parse. Training with it:
``tests/e2e/test_comet.py``."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from megatron.errors import UserError
from megatron.logging.comet import REQUIREMENTS, comet_problem
from megatron.logging.metrics import LoggingConfig, Metrics
from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs
from megatron.neox_arguments.unsupported import IGNORED_KEYS
from tests.comet_archive import archive_contains, read_offline_archive

FAKE_KEY = "fake-comet-key-5ecret-0123456789abcdef"
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}
TINY |= {"max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 2, "global_num_gpus": 1}


@pytest.fixture
def comet_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """comet_ml configured by the environment alone (no user config file), offline into ``tmp_path/comet``."""
    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "no-comet.config"))
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    for setting in ("ENV_DETAILS", "GIT_METADATA", "GIT_PATCH", "CODE"):  # what a unit test has no use for (seconds)
        monkeypatch.setenv(f"COMET_AUTO_LOG_{setting}", "false")
    return tmp_path / "comet"


def test_sink_logs_every_scalar_at_its_step_with_name_tags_and_others(
    comet_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COMET_API_KEY", FAKE_KEY)  # set, yet offline: written nowhere
    cfg = LoggingConfig(
        use_comet=True,
        comet_project="neox-forge-test",
        comet_workspace="team",
        comet_experiment_name="unit",
        comet_tags=["a", "b"],
        comet_others={"purpose": "test", "empty": None},
    )
    import comet_ml  # noqa: F401  (sets up its "comet_ml" logger, which does not propagate to the root)

    records: list[logging.LogRecord] = []
    collect = logging.Handler(logging.DEBUG)
    collect.emit = records.append  # type: ignore[method-assign]
    # comet_ml's console handler holds the stderr of whichever test imported comet_ml first: read its logger instead
    logging.getLogger("comet_ml").addHandler(collect)
    try:
        metrics = Metrics.create(cfg, rank=0, run_config={"hidden_size": 64, "optimizer": {"type": "Adam"}})
        metrics.log({"train/lm_loss": 3.25, "train/learning_rate": 1e-4}, step=1)
        metrics.log({"train/lm_loss": 2.5, "validation/lm_loss": 2.75}, step=2)
        metrics.close()
    finally:
        logging.getLogger("comet_ml").removeHandler(collect)
    said = "\n".join(r.getMessage() for r in records)
    assert "OfflineExperiment Summary" in said  # its report stays
    assert "import comet_ml before" not in said  # torch is imported first: advice for its automatic logging, off
    (archive,) = comet_env.glob("*.zip")
    comet = read_offline_archive(archive)
    assert comet["metrics"]["train/lm_loss"] == [(1, 3.25), (2, 2.5)]  # once each: no automatic second copy
    assert comet["metrics"]["train/learning_rate"] == [(1, 1e-4)]
    assert comet["metrics"]["validation/lm_loss"] == [(2, 2.75)]
    assert comet["experiment"]["project_name"] == "neox-forge-test" and comet["experiment"]["workspace"] == "team"
    assert sorted(comet["experiment"]["tags"]) == ["a", "b"]
    assert comet["others"]["Name"] == "unit" and comet["others"]["purpose"] == "test" and "empty" in comet["others"]
    assert comet["parameters"]["hidden_size"] == 64 and comet["parameters"]["optimizer|type"] == "Adam"
    assert comet["others"]["Created from"] == "gpt-neox"  # as GPT-NeoX's experiments
    assert not archive_contains(archive, FAKE_KEY.encode())


def test_only_rank_0_starts_an_experiment(comet_env: Path) -> None:
    assert Metrics.create(LoggingConfig(use_comet=True), rank=1).sinks == []
    assert not comet_env.exists()


def test_missing_api_key_online_is_one_line_on_every_rank(comet_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMET_START_ONLINE", "true")
    for rank in (0, 1):  # every rank refuses alike (rank 0 alone would leave the others waiting)
        with pytest.raises(UserError) as e:
            Metrics.create(LoggingConfig(use_comet=True), rank=rank)
        (line,) = str(e.value).splitlines()
        assert "needs an API key: set COMET_API_KEY" in line and "COMET_START_ONLINE=false" in line
    monkeypatch.delenv("COMET_START_ONLINE")  # comet_ml's default is online
    assert "set COMET_API_KEY" in (comet_problem() or "")
    monkeypatch.setenv("COMET_API_KEY", FAKE_KEY)
    assert comet_problem() is None  # with a key, online is fine (the experiment itself needs the network)


def test_deepy_refuses_a_missing_api_key_before_any_rank_starts(
    comet_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import deepy

    monkeypatch.setenv("COMET_START_ONLINE", "true")
    config = tmp_path / "comet.yml"
    config.write_text(json.dumps({**TINY, "use_comet": True, "log_dir": str(tmp_path / "logs")}))
    assert deepy.main(["train.py", str(config)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("deepy.py: error: use_comet=True logs to Comet's server, which needs an API key")
    assert "launch command" not in out and not (tmp_path / "logs").exists()  # nothing started or written
    assert deepy.main(["train.py", str(config), "--dry-run"]) == 0  # a dry run may be checked on another machine
    assert deepy.main(["generate.py", str(config), "--dry-run"]) == 0  # generation logs no metrics


def test_unparsable_setting_is_named_without_its_value(comet_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMET_START_ONLINE", "maybe-" + FAKE_KEY)
    problem = comet_problem()
    assert problem == "use_comet=True: comet_ml cannot parse the value of COMET_START_ONLINE; correct or unset it"


def test_missing_comet_ml_is_a_one_line_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "comet_ml" or m.startswith("comet_ml.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # what `import comet_ml` finds in a Python without it
    with pytest.raises(UserError) as e:
        Metrics.create(LoggingConfig(use_comet=True), rank=0)
    (line,) = str(e.value).splitlines()
    assert line.startswith("use_comet=True needs the comet_ml package") and f"pip install -r {REQUIREMENTS}" in line
    assert Metrics.create(LoggingConfig(use_comet=False), rank=0).sinks == []  # without use_comet, never imported


def test_comet_keys_are_accepted_and_comet_experiment_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    env = LaunchEnv(world_size=None, on_cpu=True)
    keys = {"use_comet": True, "comet_project": "p", "comet_tags": ["t"], "comet_others": {"k": None}}
    args = NeoXArgs({**TINY, **keys}, env=env)
    assert args.use_comet is True and args.comet_others == {"k": None}
    with caplog.at_level(logging.WARNING):
        NeoXArgs({**TINY, "comet_experiment": "run-1"}, origins={"comet_experiment": "run.yml"}, env=env)
    assert f"comet_experiment='run-1' is ignored: {IGNORED_KEYS['comet_experiment']} (set in run.yml)" in caplog.text
    with pytest.raises(ConfigError, match="comet_tags"):
        NeoXArgs({**TINY, "comet_tags": ["ok", 3]}, env=env)
