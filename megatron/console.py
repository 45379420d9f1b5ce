"""Console output that never fails on characters the console's encoding lacks.

A save path or a tokenizer string with non-ASCII characters, printed under ``LC_ALL=C`` with ``PYTHONIOENCODING``
set to ascii (or a Windows code page), raises ``UnicodeEncodeError`` in ``print`` and in logging handlers. Entry
points call :func:`safe_console` first: such characters are written as ``\\xNN``/``\\uNNNN`` escapes instead.
"""

from __future__ import annotations

import io
import sys


def safe_console() -> None:
    """Make stdout and stderr escape what their encoding cannot write (the encoding itself is kept)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors in ("strict", "surrogateescape"):
            stream.reconfigure(errors="backslashreplace")
