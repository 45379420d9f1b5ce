"""Progress bars for the long tools: tqdm on stderr, drawn only on a terminal and never under ``--quiet``.

Results and log lines go to stdout / the log; a bar is decoration for a person at a terminal, so when stderr is not
a TTY (a pipe, a file, a batch job) or the tool got ``--quiet`` nothing is drawn. Entry points call
``add_quiet_flag(parser)`` and ``set_quiet(args.quiet)``; library code calls ``progress(...)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from megatron.cluster.worker_env import launched_rank

_state = {"quiet": False}


def set_quiet(quiet: bool) -> None:
    """Turn every progress bar of this process off (``--quiet``) or back on (on a terminal)."""
    _state["quiet"] = bool(quiet)


def add_quiet_flag(parser: argparse._ActionsContainer) -> None:  # a parser or an argument group
    """The ``--quiet`` flag every long tool has."""
    parser.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn only on a terminal)")


def bars_enabled(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (stderr by default) is a terminal, ``--quiet`` was not given and this is rank 0."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    rank0 = launched_rank() == 0  # training ranks share the terminal: one bar, from rank 0
    return not _state["quiet"] and rank0 and callable(isatty) and bool(isatty())


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    stream: TextIO | None = None,
    **kwargs: Any,
) -> Any:
    """A ``tqdm`` bar on ``stream`` (stderr), disabled unless ``bars_enabled(stream)``; use it as tqdm."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        file=stream,
        disable=not bars_enabled(stream),
        leave=False,
        dynamic_ncols=True,
        **kwargs,
    )
