"""Each rank's own exit status, written into deepy's run folder, for when a launcher's status cannot be trusted.

MPICH's hydra ``mpirun`` has returned 0 after forwarding deepy's SIGTERM, although every rank had saved and exited
42 (or had stopped before its first step and exited 143). So a rank launched by deepy writes its exit status as its
last act (:func:`report_exit`, standard library only: it also runs for a rank stopped while it starts), into
``<run folder>/exit/``, the folder its ``--neox_config`` lies in (deepy's ranks read their config there, so the folder
is visible to every rank and to deepy). After a stop signal, a launcher status of 0 is checked against these
reports (:meth:`ExitReports.status`); without a stop, the launcher's status stands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from megatron.training.startup_signals import REQUEUE_EXIT_CODE as REQUEUE
from megatron.training.startup_signals import STOPPED_EXIT_CODE as STOPPED

REPORT_DIR = "exit"
RUN_DIR_MARKER = "launch.txt"  # written by deepy into every run folder (``write_run_dir``)
CONFIG_FLAG = "--neox_config"
# where launchers keep the global rank before torch.distributed's variables are derived (worker_env's sources)
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def report_dir(argv: Sequence[str]) -> str | None:
    """``<run folder>/exit`` when ``argv`` names a config in a deepy run folder, else None (a rank started by hand
    writes nothing next to its config)."""
    args = list(argv)
    if CONFIG_FLAG not in args or args.index(CONFIG_FLAG) + 1 >= len(args):
        return None
    run_dir = os.path.dirname(os.path.abspath(args[args.index(CONFIG_FLAG) + 1]))
    return os.path.join(run_dir, REPORT_DIR) if os.path.isfile(os.path.join(run_dir, RUN_DIR_MARKER)) else None


def _rank_name(env: Mapping[str, str]) -> str:
    for name in RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and len(value) <= 9:
            return f"rank-{int(value)}"
    return f"pid-{os.getpid()}"


def report_exit(code: int, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    """Write this rank's exit status into its run folder (best effort: a rank never fails for it)."""
    folder = report_dir(sys.argv if argv is None else argv)
    if folder is None:
        return
    name = _rank_name(os.environ if env is None else env)
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{int(code)}\n")
        os.replace(tmp, os.path.join(folder, name))  # whole or absent: deepy never reads half a number


class ExitReports:
    """deepy's side: the reports of one launch of ``world`` ranks in ``run_dir``."""

    def __init__(self, run_dir: str, world: int) -> None:
        self.folder = os.path.join(run_dir, REPORT_DIR)
        self.world = world

    def clear(self) -> None:
        """Remove a previous launch's reports (a run folder given with ``--run_dir`` may be reused)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def codes(self) -> dict[str, int]:
        """Rank name -> reported exit status (unreadable entries skipped)."""
        found: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.folder):
                if name.startswith("."):
                    continue
                with contextlib.suppress(OSError, ValueError), open(os.path.join(self.folder, name)) as f:
                    found[name] = int(f.read().strip())
        return found

    def summary(self) -> str:
        """``rank-0: 42, rank-1: 42, 0 of 2 missing``: what the ranks reported, for deepy's line."""
        codes = self.codes()
        listed = ", ".join(f"{name}: {code}" for name, code in sorted(codes.items()))
        return f"{listed or 'no report'}; {max(self.world - len(codes), 0)} of {self.world} ranks without a report"

    def status(self) -> int:
        """The launch's exit status as the ranks tell it: a rank's error status first; else 42 when a rank saved;
        else 143 when a rank stopped before its first step or left no report (ended by the signal before train.py ran
        its first line); else 0."""
        codes = list(self.codes().values())
        errors = [c for c in codes if c not in (0, REQUEUE, STOPPED)]
        if errors:
            return max(errors)
        if REQUEUE in codes:
            return REQUEUE
        if STOPPED in codes or len(codes) < self.world:
            return STOPPED
        return 0
