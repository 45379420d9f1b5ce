"""deepy.py's supervision of the process that starts the ranks: signals reach every rank, deepy waits for them.

The launcher (DeepSpeed's runner, or srun/mpirun/pdsh) runs in its own process group, so a terminal's Ctrl-C or a
``kill`` of deepy's group reaches deepy only, and deepy decides what the ranks get:

* SIGTERM, SIGUSR1: passed on to the ranks (their preemption handlers save at the next step boundary and exit 42);
* SIGHUP and a first SIGINT: SIGTERM to the ranks (the same save), with one line on stderr;
* a second SIGINT within :data:`STOP_NOW_WINDOW_S` seconds: "stop now", SIGKILL to the whole group.

deepy then waits for the launcher and returns its exit status (42 after a preemption save). Whatever is still
alive in the group after the launcher ended (a rank the launcher lost track of) is stopped, so no rank outlives
deepy. Local launches signal the ranks themselves (the runner's grandchildren): DeepSpeed's per-node launcher would
otherwise turn a signal into exit status 1 and a SIGKILL after 30 s.
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

STOP_NOW_WINDOW_S = 5.0  # a second Ctrl-C within this many seconds kills the ranks
LEFTOVER_GRACE_S = 10.0  # how long processes left in the group after the launcher exits get before SIGKILL
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A shell's exit status for a ``Popen.returncode`` (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def local_ranks(launcher_pid: int) -> list[psutil.Process]:
    """The ranks of a local DeepSpeed launch: children of the per-node launcher(s) the runner started."""
    try:
        nodes = psutil.Process(launcher_pid).children()
        return [rank for node in nodes for rank in node.children()]
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


class Supervisor:
    """Start ``argv`` in a new process group, relay signals to the ranks, wait, return the exit status.

    ``ranks`` finds the processes a signal goes to (default: the launcher itself, which forwards to its tasks, as
    srun and mpirun do); when it finds none yet, the signal goes to the whole group.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        ranks: Callable[[int], list[psutil.Process]] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.ranks = ranks
        self.pending: list[signal.Signals] = []
        self.last_interrupt = -1e9
        self.killed = False
        self.proc: subprocess.Popen[bytes] | None = None

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))  # acted on in the wait loop, not inside the handler

    def run(self) -> int:
        """Run to completion; raises FileNotFoundError when the launcher executable is missing."""
        previous = {s: signal.signal(s, self._handler) for s in HANDLED}
        try:
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
                while self.pending:
                    self._act(self.pending.pop(0))
                try:
                    code = self.proc.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self._stop_leftovers()
            if self.killed:
                return 128 + signal.SIGINT
            return exit_status(code)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

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
        forwarded = signal.SIGTERM if sig in (signal.SIGINT, signal.SIGHUP) else sig
        targets = self.ranks(self.proc.pid) if self.ranks else [psutil.Process(self.proc.pid)]
        if not targets:  # the ranks are not started yet: nothing to save, stop the launch
            self._killpg(signal.SIGTERM)
            return
        for target in targets:
            with contextlib.suppress(psutil.Error):  # it has just exited
                target.send_signal(forwarded)

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
