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


CHECK_CHUNK = 1 << 22  # items per vectorised step of check_index: bounds its temporaries (~100 MB) for any N


def check_index(
    path: str, bin_path: str, dtype: np.dtype, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray
) -> None:
    """Raise :class:`IndexedDatasetError` naming the file and the first bad entry unless the ``.idx`` arrays describe
    exactly the ``.bin``'s bytes as back-to-back items: every size ``>= 0``, the sizes add up to the ``.bin``'s size,
    ``pointers[i] == sum(sizes[:i]) * itemsize`` (items in order, never overlapping, no gaps, none past the end),
    and ``doc_idx`` starts at 0, never decreases and stays within ``[0, N]``.

    Vectorised and chunked (memory bounded by ``CHECK_CHUNK``): about 0.1 s per million items on a busy core
    (measured in docs/data.md).
    """
    n, itemsize = len(sizes), dtype.itemsize
    bin_size = os.path.getsize(bin_path)
    tokens = 0
    for lo in range(0, n, CHECK_CHUNK):
        s = np.asarray(sizes[lo : lo + CHECK_CHUNK])
        negative = np.flatnonzero(s < 0)
        if len(negative):
            i = lo + int(negative[0])
            raise IndexedDatasetError(f"{path}: document {i} has a negative size {int(sizes[i])}; sizes must be >= 0")
        tokens += int(s.sum(dtype=np.int64))
    if tokens * itemsize != bin_size:
        raise IndexedDatasetError(
            f"{bin_path}: size {bin_size} bytes, but {path} describes {tokens * itemsize} bytes ({tokens} tokens of "
            f"{dtype.name}); the .bin is truncated, or the .idx belongs to other data / another dtype"
        )
    carry = 0  # byte offset where the chunk's first item must start
    for lo in range(0, n, CHECK_CHUNK):
        s = np.asarray(sizes[lo : lo + CHECK_CHUNK], dtype=np.int64) * itemsize
        expected = np.empty(len(s), dtype=np.int64)
        expected[0] = carry
        np.cumsum(s[:-1], out=expected[1:])
        expected[1:] += carry
        bad = np.flatnonzero(np.asarray(pointers[lo : lo + CHECK_CHUNK]) != expected)
        if len(bad):
            i = lo + int(bad[0])
            raise IndexedDatasetError(
                f"{path}: document {i} starts at byte {int(pointers[i])} of the .bin, expected {int(expected[bad[0]])} "
                + (f"(right after document {i - 1}); " if i else "; ")
                + "the pointers overlap, skip data or run past the .bin (corrupt index)"
            )
        carry = int(expected[-1] + s[-1])
    d = np.asarray(doc_idx, dtype=np.int64)
    if len(d) and d[0] != 0:
        raise IndexedDatasetError(f"{path}: doc_idx starts at {int(d[0])}, expected 0")
    outside = np.flatnonzero((d < 0) | (d > n))
    if len(outside):
        k = int(outside[0])
        raise IndexedDatasetError(f"{path}: doc_idx[{k}] = {int(d[k])} lies outside [0, {n}] (the number of items)")
    down = np.flatnonzero(d[1:] < d[:-1])
    if len(down):
        k = int(down[0]) + 1
        raise IndexedDatasetError(
            f"{path}: doc_idx decreases at entry {k} ({int(d[k - 1])} -> {int(d[k])}); it must be non-decreasing"
        )


def file_identity(prefix: str) -> dict[str, int]:
    """What identifies the current contents of ``P.bin``/``P.idx`` cheaply: their sizes and ``mtime_ns``.

    Re-preprocessing (or copying other data over) changes at least one of them, so caches keyed by this are rebuilt.
    """
    out: dict[str, int] = {}
    for ext, path in (("bin", data_file_path(prefix)), ("idx", index_file_path(prefix))):
        st = os.stat(path)
        out[f"{ext}_size"], out[f"{ext}_mtime_ns"] = st.st_size, st.st_mtime_ns
    return out
