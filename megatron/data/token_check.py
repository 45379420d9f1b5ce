"""Token ids of a dataset checked against the model's vocabulary, once per dataset.

An id at or past the embedding's rows crashes training with an index error on one device, and with tensor
parallelism is silently masked to a zero embedding, so every text dataset is checked when training builds its data:
the smallest and largest id are found by a vectorised scan of the memory-mapped ``.bin`` and cached in a stamp
``{prefix}_token_range.json`` keyed by the files' identity (sizes and ``mtime_ns``); later runs read the stamp and
compare it with the vocabulary of the run, so a multi-TB dataset is scanned once, not per run or per vocabulary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron.data.cache_stamps import STAMP_VERSION, differences, read_stamp, write_stamp
from megatron.data.index_format import data_file_path, file_identity
from megatron.errors import DataError

logger = logging.getLogger(__name__)

SCAN_CHUNK = 1 << 26  # tokens per step of the scan (128 MB of uint16)


def stamp_path(prefix: str) -> str:
    """``{prefix}_token_range.json``."""
    return f"{prefix}_token_range.json"


def scan_token_range(dataset: Any) -> tuple[int, int]:
    """``(min id, max id)`` over all tokens of ``dataset`` (``(0, -1)`` when it has none)."""
    lo, hi = None, None
    raw = getattr(dataset, "_bin", None)
    if raw is not None:  # mmap format: the .bin is one flat token array
        flat = np.frombuffer(raw, dtype=dataset.dtype) if len(raw) else np.zeros(0, dataset.dtype)
        chunks: Any = (flat[i : i + SCAN_CHUNK] for i in range(0, len(flat), SCAN_CHUNK))
    else:  # legacy cached/lazy: item by item
        chunks = (np.asarray(dataset[i]) for i in range(len(dataset)))
    for chunk in chunks:
        if len(chunk):
            c_lo, c_hi = int(chunk.min()), int(chunk.max())
            lo = c_lo if lo is None else min(lo, c_lo)
            hi = c_hi if hi is None else max(hi, c_hi)
    return (0, -1) if lo is None else (lo, hi)  # type: ignore[return-value]


def cached_token_range(prefix: str, dataset: Any, build: bool, barrier: Callable[[], None]) -> tuple[int, int]:
    """The dataset's ``(min, max)`` id from its stamp, scanning first where the stamp is missing or stale.

    ``build`` is True on the rank that scans and writes the stamp; every rank waits on ``barrier`` before reading it
    (a rank that still finds no valid stamp, e.g. on a read-only folder, scans for itself).
    """
    identity = {"version": STAMP_VERSION, "dtype": np.dtype(dataset.dtype).name, **file_identity(prefix)}
    path = stamp_path(prefix)

    def valid() -> tuple[int, int] | None:
        found = read_stamp(path)
        ok = found is not None and not differences({k: found.get(k) for k in identity}, identity)
        if ok and isinstance(found.get("min"), int) and isinstance(found.get("max"), int):  # type: ignore[union-attr]
            return int(found["min"]), int(found["max"])  # type: ignore[index]
        return None

    if build and valid() is None:
        start = time.perf_counter()
        lo, hi = scan_token_range(dataset)
        logger.info(
            "scanned the token ids of %s in %.2f s (min %d, max %d); cached in %s",
            data_file_path(prefix),
            time.perf_counter() - start,
            lo,
            hi,
            path,
        )
        write_stamp(path, {**identity, "min": lo, "max": hi})
    barrier()
    found = valid()
    return found if found is not None else scan_token_range(dataset)


def check_token_ids(
    prefix: str, dataset: Any, vocab_size: int, build: bool = True, barrier: Callable[[], None] | None = None
) -> None:
    """Raise :class:`DataError` naming the ``.bin``, the offending id and the vocabulary size unless every token id
    of ``dataset`` lies in ``[0, vocab_size)``."""
    dtype = np.dtype(dataset.dtype)
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return  # every id the dtype can hold fits: nothing to scan
    if dtype.kind not in "iu":
        raise DataError(f"{data_file_path(prefix)}: holds {dtype.name} values, not token ids (an integer dtype)")
    lo, hi = cached_token_range(prefix, dataset, build, barrier or (lambda: None))
    if hi >= vocab_size:
        raise DataError(
            f"{data_file_path(prefix)}: token id {hi} is outside the model's vocabulary of {vocab_size} "
            "(padded_vocab_size); was it tokenised with another tokenizer?"
        )
    if lo < 0:
        raise DataError(f"{data_file_path(prefix)}: token id {lo} is negative; token ids lie in [0, {vocab_size})")
