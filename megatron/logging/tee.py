"""``log_dir``: copy a rank's stdout/stderr into text files, as GPT-NeoX's ``enable_logging`` does."""

from __future__ import annotations

import os
import socket
import sys
from typing import IO, Any


class Tee:
    """A text stream that writes to the original stream and to a file."""

    def __init__(self, stream: IO[str], path: str) -> None:
        self.stream = stream
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process

    def write(self, text: str) -> int:
        """Write to both."""
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        """Flush both."""
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class CurrentStdout:
    """Delegates to whatever ``sys.stdout`` is at write time (lets logging follow a later :func:`tee_output`)."""

    def write(self, text: str) -> int:
        """Write to the current stdout."""
        return sys.stdout.write(text)

    def flush(self) -> None:
        """Flush the current stdout."""
        sys.stdout.flush()


def tee_output(log_dir: str, rank: int, local_rank: int) -> tuple[str, str]:
    """Tee stdout/stderr to ``<log_dir>/<host>_stdout.txt`` / ``_stderr.txt`` (``<host>_rank<R>_…`` for local ranks
    other than 0); returns the two paths."""
    os.makedirs(log_dir, exist_ok=True)
    host = socket.gethostname()
    stem = host if local_rank == 0 else f"{host}_rank{rank}"
    out, err = os.path.join(log_dir, f"{stem}_stdout.txt"), os.path.join(log_dir, f"{stem}_stderr.txt")
    sys.stdout = Tee(sys.stdout, out)
    sys.stderr = Tee(sys.stderr, err)
    return out, err
