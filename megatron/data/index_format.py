"""The on-disk vocabulary shared by both indexed formats: magics, dtype codes, file names, format detection.

:mod:`megatron.data.indexed_dataset` (mmap, ``MMIDIDX``) and :mod:`megatron.data.legacy_indexed_dataset`
(``cached``/``lazy``, ``TNTIDX``) both build on this module, which imports neither.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from megatron.errors import DataError

MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
MMAP_HEADER_BYTES = 34

DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float32,
    7: np.float64,
    8: np.uint16,
}
IMPLS = ("mmap", "cached", "lazy", "infer")


class IndexedDatasetError(DataError):
    """A ``.bin``/``.idx`` pair is missing, truncated, or inconsistent; the message names the file."""


def dtype_code(dtype: Any) -> int:
    """The on-disk code of a numpy dtype (raises ValueError for dtypes the format cannot store)."""
    dt = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dt:
            return code
    raise DataError(
        f"dtype {dt} cannot be stored in an indexed dataset; valid: {[np.dtype(d).name for d in DTYPES.values()]}"
    )


def best_fitting_dtype(vocab_size: int | None = None) -> type[np.generic]:
    """GPT-NeoX's rule: ``uint16`` when the vocabulary fits (``< 65500``), else ``int32``."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    """``P.idx`` for prefix ``P``."""
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    """``P.bin`` for prefix ``P``."""
    return prefix + ".bin"


def read_magic(prefix: str) -> bytes:
    """First 9 bytes of ``P.idx`` (raises IndexedDatasetError when the file is missing)."""
    path = index_file_path(prefix)
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"index file not found: {path} (expected {prefix}.bin and {prefix}.idx)")
    with open(path, "rb") as f:
        return f.read(9)


def infer_dataset_impl(prefix: str) -> str:
    """``"mmap"`` or ``"cached"`` from the magic bytes of ``P.idx``."""
    magic = read_magic(prefix)
    if magic == MMAP_MAGIC:
        return "mmap"
    if magic[:8] == LEGACY_MAGIC:
        return "cached"
    raise IndexedDatasetError(
        f"{index_file_path(prefix)}: unknown magic {magic!r}; expected {MMAP_MAGIC!r} (mmap) or {LEGACY_MAGIC!r} (cached/lazy)"
    )
