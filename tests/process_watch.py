"""The run-time half of the fast-tier rule: a test outside ``launches`` starts no interpreter and no launcher.

:mod:`tests.launch_scan` marks what the test code itself starts; this catches what the code under test starts
(a tool that runs ``python``, a launcher that runs ``mpirun`` …) through Python's audit hooks
(``subprocess.Popen``, ``os.posix_spawn``, ``os.system`` events). Short helper programs such as ``git`` stay allowed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from typing import Any

# Programs that start ranks, launchers or clusters (besides any Python interpreter or ``*.py`` script).
LAUNCH_PROGRAMS = frozenset(
    {"mpirun", "mpiexec", "pdsh", "srun", "sbatch", "salloc", "ssh", "sshd", "deepspeed", "torchrun", "ip"}
    | {"slurmctld", "slurmd", "munged"}
)


def is_launch_program(program: str) -> bool:
    """``python3``, ``/x/.venv/bin/python``, ``deepy.py``, ``mpirun`` … → True; ``git``, ``true`` → False."""
    name = os.path.basename(program)
    if name.startswith("python") or name.endswith(".py") or name in LAUNCH_PROGRAMS:
        return True
    return os.path.realpath(program) == os.path.realpath(sys.executable)


def _argv_program(argv: Any) -> str | None:
    if isinstance(argv, str | bytes | os.PathLike):
        words = shlex.split(os.fsdecode(argv))
        return words[0] if words else None
    items = list(argv or [])
    if len(items) >= 3 and os.path.basename(os.fsdecode(items[0])) in ("sh", "bash") and items[1] == "-c":
        return _argv_program(items[2])  # a shell command line: judge the program it runs
    return os.fsdecode(items[0]) if items else None


class ProcessWatch:
    """Records launch-program starts while :meth:`watching` is open. One per pytest session (audit hooks stay
    installed for the life of the interpreter, so :meth:`install` is called once)."""

    def __init__(self) -> None:
        self._seen: list[str] | None = None

    def install(self) -> None:
        sys.addaudithook(self._hook)

    @contextlib.contextmanager
    def watching(self) -> Iterator[list[str]]:
        seen: list[str] = []
        outer, self._seen = self._seen, seen
        try:
            yield seen
        finally:
            self._seen = outer

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self._seen is None or event not in ("subprocess.Popen", "os.posix_spawn", "os.system"):
            return
        if event == "os.system":
            program = _argv_program(args[0])
        elif event == "subprocess.Popen":
            program = _argv_program(args[1]) if args[1] else None
            program = program or (os.fsdecode(args[0]) if args[0] else None)
        else:
            program = _argv_program(args[1]) or os.fsdecode(args[0])
        if program is not None and is_launch_program(program):
            self._seen.append(f"{event}: {program}")
