"""Datasets written all-or-nothing.

Writers (preprocessing, chat-template preprocessing, log-prob precompute) stream into ``<prefix>.bin.partial`` and
``<prefix>.idx.partial``; only when the whole run succeeded are the files renamed onto ``<prefix>.bin`` and then
``<prefix>.idx`` (the index last: its existence means the dataset is complete). On any error, interrupts included,
the partial files are closed and removed, and an existing dataset of the same name is left as it was.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from megatron.data.index_format import data_file_path, index_file_path

PARTIAL = ".partial"


@contextlib.contextmanager
def staged_builders(prefixes: Mapping[str, str], make: Callable[[str, str], Any]) -> Iterator[dict[str, Any]]:
    """Yield ``{name: builder}`` with ``make(name, partial_bin_path)`` for each ``name -> final prefix``.

    On a clean exit of the ``with`` block every builder is finalised into its partial ``.idx`` and the pairs are
    renamed into place; if the block raises, nothing named like a final output is created or changed.
    """
    builders: dict[str, Any] = {}
    try:
        for name, prefix in prefixes.items():
            builders[name] = make(name, data_file_path(prefix) + PARTIAL)
        yield builders
        for name, prefix in prefixes.items():
            builders[name].finalize(index_file_path(prefix) + PARTIAL)
        for prefix in prefixes.values():
            os.replace(data_file_path(prefix) + PARTIAL, data_file_path(prefix))
            os.replace(index_file_path(prefix) + PARTIAL, index_file_path(prefix))
    except BaseException:
        for builder in builders.values():
            _close_quietly(builder)
        for prefix in prefixes.values():
            for path in (data_file_path(prefix) + PARTIAL, index_file_path(prefix) + PARTIAL):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        raise


def _close_quietly(builder: Any) -> None:
    """Close a builder's open ``.bin`` (mmap builders hold ``_data_file``, legacy ones ``_out``)."""
    f = getattr(builder, "_data_file", None) or getattr(builder, "_out", None)
    if f is not None and not f.closed:
        f.close()


def clean_exit_on_sigterm() -> None:
    """Make ``SIGTERM`` (``kill``, ``timeout``, a batch system) end this process through ``SystemExit(143)``, so
    :func:`staged_builders` removes its partial files as it does on an error or Ctrl-C. Forked worker processes
    keep the default action (they hold no output files)."""
    owner = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _worker_start(initializer: Callable[..., None], args: tuple[Any, ...]) -> None:
    """A pool worker's first step: the default SIGTERM action (a worker holds no output, so ``Pool.terminate`` simply
    ends it), then the signal unblocked (one that came while it was starting is delivered now), then ``initializer``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    initializer(*args)


def worker_pool(workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> Any:
    """A process pool whose ``terminate()`` never hangs, also with :func:`clean_exit_on_sigterm` installed.

    A worker forked with the parent's Python SIGTERM handler can lose a SIGTERM that arrives while it is still
    starting (CPython clears pending signal flags in the child after ``fork``), and then blocks on the task queue
    forever while ``terminate()`` waits for it (seen as an intermittent hang when the first input line is bad). So
    SIGTERM stays blocked across the forks and each worker restores the default action before unblocking it.
    """
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return ctx.Pool(workers, initializer=_worker_start, initargs=(initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
