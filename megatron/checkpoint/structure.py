"""A checkpoint's files are untrusted data: a pickled value of another type than DeepSpeed writes (a string where a
fragment address belongs, a number where a dict does) must end a read with one line naming the file, not with an
``AttributeError`` traceback from deep inside the parser."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from megatron.checkpoint.layout import CheckpointError
from megatron.errors import UserError

STRUCTURE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError, RuntimeError, RecursionError)


@contextlib.contextmanager
def checkpoint_structure(where: str | Path) -> Iterator[None]:
    """Turn an error raised by reading the structure of ``where`` into one ``CheckpointError`` line (errors that are
    already one line, ``UserError``, pass unchanged)."""
    try:
        yield
    except UserError:
        raise
    except STRUCTURE_ERRORS as e:
        detail = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"{where} does not hold the structure of a DeepSpeed / GPT-NeoX checkpoint ({type(e).__name__}: {detail})"
        ) from None
