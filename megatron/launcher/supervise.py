"""deepy.py's supervision of the process that starts the ranks: signals reach every rank, deepy waits for them.

The launcher (DeepSpeed's runner, or srun/mpirun/pdsh) runs in its own process group, so a terminal's Ctrl-C or a
``kill`` of deepy's group reaches deepy only, and deepy decides what the ranks get:

* SIGTERM, SIGUSR1: passed on to the ranks (their preemption handlers save at the next step boundary and exit 42);
* SIGHUP and a first SIGINT: SIGTERM to the ranks (the same save), with one line on stderr;
* a second SIGINT within :data:`STOP_NOW_WINDOW_S` seconds: "stop now", SIGKILL to the whole group.

deepy then waits for the launcher and returns its exit status (42 after a preemption save; ``STOPPED_EXIT_CODE``,
with one line, when the ranks stopped before their first step, or when the signal came before the launch started).
Whatever is still alive in the group after the launcher ended (a rank the launcher lost track of) is stopped, so no
rank outlives deepy.

How the signal reaches the ranks depends on the launcher: locally deepy signals the ranks themselves (the children of
DeepSpeed's per-node launcher, which would turn a signal into exit status 1 and a SIGKILL after 30 s), each only
once it catches the signal (``signal_ranks.ready``: a rank still starting its interpreter would be killed);
srun and Open MPI's mpirun end their tasks on SIGTERM without passing it on, so they get a signal they forward
(``ClusterCommand.signal_map``, SIGUSR1); MPICH's hydra passes SIGTERM on; pdsh's ssh passes nothing on, so deepy
runs ``signal_ranks.py`` on every host through pdsh (``relay``) until every rank there caught the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import IO, TextIO

import psutil

from megatron.launcher.exit_reports import ExitReports
from megatron.launcher.signal_ranks import send_when_ready
from megatron.training.startup_signals import STOPPED_EXIT_CODE

STOP_NOW_WINDOW_S = 5.0  # a second Ctrl-C within this many seconds kills the ranks
LEFTOVER_GRACE_S = 10.0  # how long processes left in the group after the launcher exits get before SIGKILL
RELAY_RETRY_S = 1.0  # how often a relay (pdsh) is repeated while a host has ranks not yet catching the signal
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A shell's exit status for a ``Popen.returncode`` (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def local_ranks(launcher_pid: int, depth: int = 2) -> list[psutil.Process]:
    """The ranks of a local DeepSpeed launch: the launcher's descendants ``depth`` levels down (2: DeepSpeed's
    runner -> per-node launcher -> ranks; 1: the per-node launcher started directly -> ranks)."""
    try:
        level = [psutil.Process(launcher_pid)]
        for _ in range(depth):
            level = [child for proc in level for child in proc.children()]
        return level
    except psutil.Error:
        return []


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (zombies excluded: a container's PID 1 may never reap them)."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (OSError, psutil.Error):
            continue
    return members


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):  # closed or detached
        return False


def _relay_lines(source: TextIO, sink: IO[bytes] | None) -> None:
    """Copy the terminal's lines to the ranks' stdin until end of input (Ctrl-D) or until they stop reading."""
    if sink is None:
        return
    with contextlib.suppress(OSError, ValueError):
        for line in source:
            sink.write(line.encode())
            sink.flush()
    with contextlib.suppress(OSError, ValueError):
        sink.close()


def _say(message: str) -> None:
    print(f"deepy.py: {message}", file=sys.stderr, flush=True)


class SignalQueue:
    """deepy's handlers for :data:`HANDLED`: a signal is only queued (acted on by :class:`Supervisor`). Installed
    before the configs are read, so a signal during deepy's own start-up is not lost (nor a traceback)."""

    def __init__(self) -> None:
        self.pending: list[signal.Signals] = []
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> SignalQueue:
        for s in HANDLED:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))


def stopped_before_launch(sig: signal.Signals) -> int:
    """One line and :data:`STOPPED_EXIT_CODE`: a stop signal came before any rank was started."""
    _say(f"{sig.name} before the launch: no rank was started, nothing to save (exit status {STOPPED_EXIT_CODE})")
    return STOPPED_EXIT_CODE


class Supervisor:
    """Start ``argv`` in a new process group, relay signals to the ranks, wait, return the exit status.

    Where a stop signal goes: ``ranks`` (local launches) finds the rank processes, each signalled once it catches
    the signal; ``relay`` (pdsh) is called with the signal until it returns 0 (every rank reached); otherwise the
    launcher itself gets it, as ``signal_map`` translates it (srun and mpirun forward SIGUSR1, not SIGTERM).
    ``signals``: deepy's queue, installed early (default: one installed for the run). ``reports``: the ranks' own
    exit statuses, which overrule a launcher's 0 after a stop signal (MPICH's hydra has returned 0 there).
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        ranks: Callable[[int], list[psutil.Process]] | None = None,
        *,
        signals: SignalQueue | None = None,
        relay: Callable[[signal.Signals], int] | None = None,
        signal_map: dict[str, str] | None = None,
        reports: ExitReports | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.ranks = ranks
        self.relay = relay
        self.signal_map = signal_map or {}
        self.signals = signals
        self.reports = reports
        self.stop: signal.Signals | None = None  # the stop signal the ranks are to get (None: no stop asked)
        self.delivered: set[int] = set()  # local ranks that got ``stop``
        self.last_interrupt = -1e9
        self.killed = False
        self.proc: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        """Run to completion; raises FileNotFoundError when the launcher executable is missing."""
        queue = self.signals or SignalQueue().install()
        try:
            if queue.pending:  # deepy was asked to stop while it read the configs: start nothing
                return stopped_before_launch(queue.pending[0])
            # The ranks run in their own process group, so that a terminal's Ctrl-C reaches only deepy (which asks
            # them to save). A process group that is not the terminal's foreground group is stopped (SIGTTIN) when it
            # reads the terminal, so a terminal's lines are relayed through a pipe (interactive generation reads
            # them); a file or pipe on stdin is passed on as it is.
            tty = _stdin_is_tty()
            stdin = subprocess.PIPE if tty else None
            self.proc = subprocess.Popen(self.argv, env=self.env, process_group=0, stdin=stdin)
            if tty:
                threading.Thread(target=_relay_lines, args=(sys.stdin, self.proc.stdin), daemon=True).start()
            while True:
                while queue.pending:
                    self._act(queue.pending.pop(0))
                if self.stop is not None and self.ranks is not None:
                    self._deliver_local(self.stop)
                try:
                    code = self.proc.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self._stop_leftovers()
            if self.killed:
                return 128 + signal.SIGINT
            status = exit_status(code)
            if self.stop is not None and status == 0 and self.reports is not None:
                status = self._reported_status()
            if self.stop is not None and status in (128 + self.stop, 256 - self.stop, int(self.stop)):
                # a rank ended by the stop signal itself (hit before its interpreter ran train.py's first line;
                # 256 - N: DeepSpeed's per-node launcher's sys.exit(-N), N: MPICH hydra's report of a rank killed by
                # signal N): no rank had trained, nothing was saved
                status = STOPPED_EXIT_CODE
            if self.stop is not None and status == STOPPED_EXIT_CODE:
                _say(
                    "stopped before the first training step: nothing to save, no checkpoint written or changed "
                    f"(exit status {STOPPED_EXIT_CODE}; the same command starts the run again)"
                )
            return status
        finally:
            if self.signals is None:
                queue.uninstall()

    def _reported_status(self) -> int:
        """The ranks' own account when the launcher returned 0 after a stop signal (0 if they agree)."""
        assert self.reports is not None
        status = self.reports.status()
        if status != 0:
            _say(
                f"the launcher returned 0 after the {self.stop.name if self.stop else 'stop'} signal, but the ranks "
                f"reported otherwise ({self.reports.summary()}): exit status {status}"
            )
        return status

    def _act(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if sig == signal.SIGINT:
            now = time.monotonic()
            if now - self.last_interrupt <= STOP_NOW_WINDOW_S:
                _say("second interrupt: stopping now, killing the ranks (no checkpoint is saved)")
                self.killed = True
                self._killpg(signal.SIGKILL)
                return
            self.last_interrupt = now
            _say(
                "interrupt: asking the ranks to save and stop "
                f"(press Ctrl-C again within {STOP_NOW_WINDOW_S:.0f} s to stop now without saving)"
            )
        elif sig == signal.SIGHUP:
            _say("hangup: asking the ranks to save and stop")
        asked = signal.SIGTERM if sig in (signal.SIGINT, signal.SIGHUP) else sig
        forwarded = signal.Signals[self.signal_map.get(asked.name, asked.name)]
        self.stop = forwarded
        self.delivered.clear()  # every signal received is passed on once more
        if self.ranks is not None:
            self._deliver_local(forwarded)  # and again from the wait loop, to ranks not ready yet
        elif self.relay is not None:
            threading.Thread(target=self._relay_until_delivered, args=(forwarded,), daemon=True).start()
        else:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(self.proc.pid, forwarded)

    def _deliver_local(self, sig: signal.Signals) -> None:
        """``sig`` to the local ranks that catch it and have not had it yet (one still starting waits)."""
        assert self.proc is not None and self.ranks is not None
        waiting = [r.pid for r in self.ranks(self.proc.pid) if r.pid not in self.delivered]
        self.delivered.update(send_when_ready(waiting, sig))

    def _relay_until_delivered(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.relay is not None
        while self.proc.poll() is None and self.stop == sig:
            if self.relay(sig) == 0:
                return
            time.sleep(RELAY_RETRY_S)

    def _killpg(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _group_alive(self) -> bool:
        assert self.proc is not None
        return bool(group_members(self.proc.pid))

    def _stop_leftovers(self) -> None:
        """Ranks must not outlive deepy: wait a little for stragglers of the group, then SIGTERM, then SIGKILL."""
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                if not self._group_alive():
                    return
                _say(f"processes of the launch still running after the launcher exited: sending {sig.name}")
                self._killpg(sig)
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
