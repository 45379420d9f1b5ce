"""train.py: user errors (ConfigError / CheckpointError / DataError) are one line without a traceback; any other
exception is a bug and keeps its traceback; a preempted run exits with the requeue code, one stopped before its first
step with 143."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from megatron.errors import DataError
from megatron.training.preemption import REQUEUE_EXIT_CODE
from megatron.training.startup_signals import STOPPED_EXIT_CODE
from tests.harness import REPO_ROOT


def _run_train(monkeypatch: pytest.MonkeyPatch, outcome: Any) -> int:
    import megatron.distributed
    import megatron.training.pretraining
    from megatron.neox_arguments import NeoXArgs

    def fake_pretrain(args: Any, startup: Any = None) -> Any:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome() if callable(outcome) else outcome

    monkeypatch.setattr(
        NeoXArgs,
        "consume_neox_args",
        classmethod(lambda cls, **kw: SimpleNamespace(log_dir=None, rank=0, hidden_size=None, num_layers=None)),
    )
    monkeypatch.setattr(megatron.training.pretraining, "pretrain", fake_pretrain)
    monkeypatch.setattr(megatron.distributed, "shutdown_and_exit", lambda code: None)
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    sys.modules.pop("train", None)
    import train

    return train.main()


def test_user_error_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert _run_train(monkeypatch, DataError("data_path /x/y_text_document: no .idx file")) == 1
    out, err = capsys.readouterr()
    assert err == "error: data_path /x/y_text_document: no .idx file\n" and "Traceback" not in out + err


def test_a_bug_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    assert _run_train(monkeypatch, ValueError("internal shape bug")) == 1
    out, err = capsys.readouterr()
    logged = out + err + caplog.text
    assert "training failed" in logged and "Traceback" in logged and "ValueError: internal shape bug" in logged
    assert "error: internal" not in err


def test_preempted_run_exits_with_the_requeue_code(monkeypatch: pytest.MonkeyPatch) -> None:
    result = SimpleNamespace(preempted=True, iteration=7, stopped_before_training=False)
    assert _run_train(monkeypatch, result) == REQUEUE_EXIT_CODE == 42


def test_a_run_stopped_before_its_first_step_exits_143(monkeypatch: pytest.MonkeyPatch) -> None:
    result = SimpleNamespace(preempted=False, iteration=0, stopped_before_training=True)
    assert _run_train(monkeypatch, result) == STOPPED_EXIT_CODE == 143


def test_a_stop_signal_during_a_class_creation_exits_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up stop raised while Python creates a class (a dataclass field's ``__set_name__`` during an import,
    seen under srun): Python 3.11 wraps it in a RuntimeError; the rank still ends with 143 and no traceback."""
    import signal

    from megatron.training.startup_signals import StartupSignals, stop_in_chain

    class Field:
        def __set_name__(self, owner: type, name: str) -> None:
            signal.raise_signal(signal.SIGUSR1)  # the handler raises StoppedBeforeTraining here

    def import_under_a_stop() -> None:
        startup = StartupSignals().install()
        try:
            try:
                type("ShapeKeys", (), {"num_layers": Field()})
            except BaseException as e:
                assert stop_in_chain(e) is not None  # wrapped (3.11) or not (3.12+): found either way
                raise
        finally:
            startup.uninstall()

    assert _run_train(monkeypatch, import_under_a_stop) == STOPPED_EXIT_CODE
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err + caplog.text and "training failed" not in caplog.text
