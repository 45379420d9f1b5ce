"""Deliver a stop signal to a launch's ranks only once they catch it (standard library only; Linux ``/proc``).

A rank that has just been started is, for a moment, an interpreter that has not run ``train.py``'s first line: a
SIGTERM then kills it with the default action (a stray exit status instead of a save or a clean stop). deepy
therefore signals a rank only when ``/proc/PID/status`` shows that the signal is caught (``SigCgt``) by the rank's own
program (not by the launcher it was forked from and has not yet replaced with ``exec``), and keeps the signal pending
for the others until they are ready.

Run by file path on every host of a pdsh launch (pdsh's ssh does not pass signals on)::

    python signal_ranks.py SIGTERM /path/to/run/neox_config.json

signals that host's ranks of that run (processes whose command line holds ``--local_rank=…`` and ``--neox_config
PATH``); exit status 0 when at least one rank was signalled and none was left unready, else :data:`NOT_READY`.
"""

from __future__ import annotations

import os
import signal
import sys
from itertools import pairwise

NOT_READY = 3  # exit status: no rank of the run found, or one not yet catching the signal (deepy tries again)


def catches(pid: int, sig: signal.Signals) -> bool:
    """True when process ``pid`` has a handler for ``sig`` (its ``SigCgt`` mask), False if not or gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty when it is gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def ready(pid: int, sig: signal.Signals) -> bool:
    """``pid`` runs its own program (not its launcher's, forked and not yet replaced) and catches ``sig``."""
    own = cmdline(pid)
    return bool(own) and own != cmdline(parent(pid)) and catches(pid, sig)


def send_when_ready(pids: list[int], sig: signal.Signals) -> list[int]:
    """Send ``sig`` to those of ``pids`` that are :func:`ready`; returns the pids signalled."""
    sent = []
    for pid in pids:
        if ready(pid, sig):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # it has just ended
                continue
            sent.append(pid)
    return sent


def run_ranks(config_path: str) -> list[int]:
    """This host's rank processes of the run whose resolved config is ``config_path`` (started by DeepSpeed's
    per-node launcher: ``python -u SCRIPT --local_rank=N --neox_config PATH``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        args = cmdline(int(entry))
        if any(a.startswith("--local_rank=") for a in args) and ("--neox_config", config_path) in pairwise(args):
            found.append(int(entry))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in signal.Signals.__members__:
        print("usage: signal_ranks.py SIGNAL CONFIG_PATH", file=sys.stderr)
        return 2
    sig = signal.Signals[argv[0]]
    ranks = run_ranks(argv[1])
    sent = send_when_ready(ranks, sig)
    return 0 if sent and len(sent) == len(ranks) else NOT_READY


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
