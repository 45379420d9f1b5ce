"""How a stop signal is relayed, without training: the signal each launcher's command gets (srun and Open MPI's mpirun
SIGUSR1, hydra SIGTERM as it is, pdsh a relay command), the readiness check that keeps a signal from a process that
does not catch it yet, a rank's start-up handlers, and deepy's status for a launch stopped before it trained."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launcher.signal_ranks import NOT_READY, catches, main, ready, send_when_ready
from megatron.launcher.supervise import SignalQueue, Supervisor
from megatron.training.startup_signals import STOPPED_EXIT_CODE, StartupSignals, StoppedBeforeTraining
from tests.unit.test_cluster_commands import command

# a child that catches SIGTERM only after a marker file exists, then exits 42 on it
LATE_HANDLER = """
import os, signal, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
time.sleep(60)
"""


def _wait(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_process_gets_the_signal_only_once_it_catches_it(tmp_path: Path) -> None:
    marker = tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", LATE_HANDLER, str(marker)])
    try:
        _wait(lambda: len(Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")) > 3)  # exec'd
        assert not catches(child.pid, signal.SIGTERM) and not ready(child.pid, signal.SIGTERM)
        assert send_when_ready([child.pid], signal.SIGTERM) == []  # held back: it would have died of it
        assert child.poll() is None
        marker.touch()
        _wait(lambda: catches(child.pid, signal.SIGTERM))
        assert send_when_ready([child.pid], signal.SIGTERM) == [child.pid]
        assert child.wait(timeout=20) == 42  # its handler ran
    finally:
        child.kill()
        child.wait()


def test_relay_script_finds_no_rank_of_an_unknown_run(tmp_path: Path) -> None:
    assert main(["SIGTERM", str(tmp_path / "no-such-run" / "neox_config.json")]) == NOT_READY
    assert main(["NOSIG", "x"]) == 2


def test_srun_and_mpirun_get_sigusr1_hydra_sigterm_pdsh_a_relay(tmp_path: Path) -> None:
    for launcher in ("slurm", "openmpi"):
        _, cmd = command(tmp_path, launcher=launcher)
        assert cmd.signal_map["SIGTERM"] == "SIGUSR1" and not any("SIGUSR" in n for n in cmd.notes)
        _, cmd = command(tmp_path, launcher=launcher, preemption_signals=["SIGTERM", "SIGUSR2"])
        assert cmd.signal_map["SIGTERM"] == "SIGUSR2"
        _, cmd = command(tmp_path, launcher=launcher, preemption_signals=["SIGTERM"])
        assert cmd.signal_map == {} and any("includes SIGUSR1 or SIGUSR2" in n for n in cmd.notes), cmd.notes
    _, cmd = command(tmp_path, launcher="mvapich")
    assert cmd.signal_map == {} and cmd.relay == []
    _, cmd = command(tmp_path, launcher="pdsh")
    assert cmd.relay[:2] == ["pdsh", "-S"] and cmd.relay[cmd.relay.index("-w") + 1] == "node-a,node-b,node-c"
    assert cmd.relay[-1].endswith("signal_ranks.py {signal} /runs/r1/neox_config.json")


def test_startup_handlers_raise_before_the_group_forms_and_record_after() -> None:
    startup = StartupSignals().install()
    try:
        with pytest.raises(StoppedBeforeTraining):
            signal.raise_signal(signal.SIGUSR1)
        startup.hold()
        signal.raise_signal(signal.SIGTERM)  # recorded only
        assert startup.received == "SIGTERM"
        startup.keep_only(["SIGTERM"])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # not a preemption signal: its default is back
    finally:
        startup.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_signal_before_the_launch_starts_nothing(capsys) -> None:
    queue = SignalQueue().install()
    try:
        queue.pending.append(signal.SIGTERM)  # it came while deepy read the configs
        sup = Supervisor([sys.executable, "-c", "raise SystemExit('must not start')"], signals=queue)
        assert sup.run() == STOPPED_EXIT_CODE and sup.proc is None
        assert "SIGTERM before the launch: no rank was started" in capsys.readouterr().err
    finally:
        queue.uninstall()


# a launcher that reports the relayed SIGTERM as the given exit status, the way each reports a rank killed by it
REPORTS = (
    "import signal, sys, time; signal.signal(15, lambda *a: sys.exit({code})); print('up', flush=True); time.sleep(60)"
)


@pytest.mark.launches  # the Supervisor starts a Python child per case
@pytest.mark.parametrize(("reported", "deepy"), [(143, 143), (241, 143), (15, 143), (42, 42), (1, 1)])
def test_a_launch_ended_by_the_stop_signal_itself_is_reported_as_stopped(reported: int, deepy: int, capfd) -> None:
    """srun/mpirun 128+N, DeepSpeed's launcher 256-N, hydra N for a rank killed by the relayed signal N before any
    handler existed (nothing trained): 143 with one line; a save (42) and a failure (1) pass through unchanged."""
    queue = SignalQueue().install()
    try:
        sup = Supervisor([sys.executable, "-c", REPORTS.format(code=reported)], signals=queue)

        def stop_once_it_catches(*_: object) -> None:  # deepy gets SIGTERM once the launcher's handler exists
            if sup.proc is not None and catches(sup.proc.pid, signal.SIGTERM):
                queue.pending.append(signal.SIGTERM)
            else:
                signal.setitimer(signal.ITIMER_REAL, 0.05)

        previous = signal.signal(signal.SIGALRM, stop_once_it_catches)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            assert sup.run() == deepy
        finally:
            signal.signal(signal.SIGALRM, previous)
        err = capfd.readouterr().err
        assert err.count("stopped before the first training step: nothing to save") == (deepy == STOPPED_EXIT_CODE)
    finally:
        queue.uninstall()
