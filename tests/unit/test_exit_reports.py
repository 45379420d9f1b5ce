"""The ranks' own exit statuses in deepy's run folder, and deepy trusting them over a launcher's 0 after a stop signal
(MPICH's hydra has returned 0 there although its ranks saved and exited 42)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron.launcher.exit_reports import ExitReports, report_dir, report_exit
from megatron.launcher.launch import CONFIG_NAME
from megatron.launcher.supervise import SignalQueue, Supervisor
from megatron.training.startup_signals import REQUEUE_EXIT_CODE, STOPPED_EXIT_CODE
from tests.harness import REPO_ROOT


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_NAME).write_text("{}")
    (run / "launch.txt").write_text("mpirun ...\n")
    return run


def test_a_rank_reports_into_a_deepy_run_folder_only(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    argv = ["train.py", "--neox_config", str(run / CONFIG_NAME)]
    report_exit(42, argv, {"PMI_RANK": "1"})  # hydra's variable: RANK is derived later
    report_exit(143, argv, {"RANK": "0", "PMI_RANK": "7"})  # RANK, once set, wins
    assert sorted(os.listdir(run / "exit")) == ["rank-0", "rank-1"]  # no temporary file left
    assert ExitReports(str(run), 2).codes() == {"rank-0": 143, "rank-1": 42}
    # a config outside a deepy run folder (a rank started by hand), or no config flag: nothing is written
    (tmp_path / "mine.json").write_text("{}")
    report_exit(0, ["train.py", "--neox_config", str(tmp_path / "mine.json")], {"RANK": "0"})
    report_exit(0, ["train.py", "--neox_config"], {"RANK": "0"})
    assert report_dir(["train.py"]) is None and not (tmp_path / "exit").exists()


@pytest.mark.parametrize(
    ("codes", "world", "status"),
    [
        ({"rank-0": 42, "rank-1": 42}, 2, REQUEUE_EXIT_CODE),
        ({"rank-0": 143, "rank-1": 143}, 2, STOPPED_EXIT_CODE),
        ({"rank-0": 143}, 2, STOPPED_EXIT_CODE),  # rank 1 ended by the signal before train.py ran
        ({}, 2, STOPPED_EXIT_CODE),
        ({"rank-0": 0, "rank-1": 0}, 2, 0),  # the run ended as the signal came: the launcher's 0 was right
        ({"rank-0": 0}, 2, STOPPED_EXIT_CODE),
        ({"rank-0": 42, "rank-1": 1}, 2, 1),  # a rank's error comes first
    ],
)
def test_status_from_the_reports(tmp_path: Path, codes: dict[str, int], world: int, status: int) -> None:
    reports = ExitReports(str(tmp_path), world)
    (tmp_path / "exit").mkdir()
    for name, code in codes.items():
        (tmp_path / "exit" / name).write_text(f"{code}\n")
    (tmp_path / "exit" / ".rank-9.123").write_text("4")  # a report being written is not read
    assert reports.status() == status


def test_a_reused_run_folder_starts_without_reports(tmp_path: Path) -> None:
    reports = ExitReports(str(tmp_path), 1)
    (tmp_path / "exit").mkdir()
    (tmp_path / "exit" / "rank-0").write_text("42\n")
    reports.clear()
    assert reports.codes() == {} and reports.status() == STOPPED_EXIT_CODE


# A launcher that behaves as hydra did: it forwards SIGTERM to its two ranks, waits for them and returns 0 whatever
# they returned. Each rank reports (as train.py's ranks do) and exits 42, or (argv[2] == "early") dies of the signal
# before it could catch it.
HYDRA_LIKE = """
import os, signal, subprocess, sys, time
RANK = '''
import os, signal, sys, time
from megatron.launcher.exit_reports import report_exit
if sys.argv[3] != "early":
    def stop(*_):
        report_exit(42)
        os._exit(42)
    signal.signal(signal.SIGTERM, stop)
open(sys.argv[4], "w").close()
time.sleep(60)
'''
config = sys.argv[1]
ranks = [
    subprocess.Popen([sys.executable, "-c", RANK, "--neox_config", config, sys.argv[2], f"{config}.{r}"],
                     env={**os.environ, "PMI_RANK": str(r)})
    for r in range(2)
]
signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in ranks])
open(config + ".up", "w").close()
while any(p.poll() is None for p in ranks):
    time.sleep(0.02)
sys.exit(0)
"""


def _stop_hydra_like(tmp_path: Path, mode: str, reports: ExitReports | None) -> int:
    run = _run_folder(tmp_path)
    config = str(run / CONFIG_NAME)
    argv = [sys.executable, "-c", HYDRA_LIKE, config, mode]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    queue = SignalQueue().install()
    try:
        supervisor = Supervisor(argv, env, signals=queue, reports=reports)
        ready = [Path(f"{config}.up"), Path(f"{config}.0"), Path(f"{config}.1")]

        def stop_when_ready() -> None:
            deadline = time.monotonic() + 60
            while not all(p.exists() for p in ready) and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)  # to deepy (this process): relayed to the launcher

        threading.Thread(target=stop_when_ready, daemon=True).start()
        return supervisor.run()
    finally:
        queue.uninstall()


@pytest.mark.launches
def test_a_launchers_zero_after_a_stop_is_checked_against_the_ranks(tmp_path: Path, capfd) -> None:
    run = tmp_path / "a" / "run"
    (tmp_path / "a").mkdir()
    code = _stop_hydra_like(tmp_path / "a", "catch", ExitReports(str(run), 2))
    assert code == REQUEUE_EXIT_CODE
    err = capfd.readouterr().err
    assert "the launcher returned 0 after the SIGTERM signal, but the ranks reported otherwise" in err, err
    assert "rank-0: 42, rank-1: 42; 0 of 2 ranks without a report): exit status 42" in err, err
    # ranks that died of the signal before they could catch it leave no report: stopped, nothing saved
    (tmp_path / "b").mkdir()
    code = _stop_hydra_like(tmp_path / "b", "early", ExitReports(str(tmp_path / "b" / "run"), 2))
    assert code == STOPPED_EXIT_CODE
    assert "stopped before the first training step: nothing to save" in capfd.readouterr().err
    # without the reports deepy would have returned the launcher's 0: the check is what makes the difference
    (tmp_path / "c").mkdir()
    assert _stop_hydra_like(tmp_path / "c", "catch", None) == 0


@pytest.mark.launches
def test_without_a_stop_signal_the_launchers_status_stands(tmp_path: Path) -> None:
    reports = ExitReports(str(tmp_path), 2)  # no report at all: would read as "stopped"
    code = Supervisor([sys.executable, "-c", "pass"], dict(os.environ), reports=reports).run()
    assert code == 0
    code = Supervisor([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), reports=reports).run()
    assert code == 3
