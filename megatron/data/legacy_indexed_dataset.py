"""The legacy ``cached``/``lazy`` indexed format (magic ``TNTIDX``): reader and builder.

``.idx`` layout, little-endian::

    8 bytes magic b"TNTIDX\\x00\\x00", <Q version 1, <QQ (dtype code, element size), <QQ (N items, S size entries),
    <Q D doc_idx entries, then int64 arrays dim_offsets[N+1], data_offsets[N+1] (in elements), sizes[S], doc_idx[D].

``.bin`` is the raw concatenation of items. Items here are 1-D, so ``sizes`` holds one length per item.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from megatron.data.index_format import (
    DTYPES,
    LEGACY_MAGIC,
    IndexedDatasetError,
    check_index,
    data_file_path,
    dtype_code,
    index_file_path,
)
from megatron.errors import DataError

_HEADER_BYTES = 8 + 8 + 16 + 16 + 8


class IndexedDataset:
    """Reads a ``TNTIDX`` dataset lazily (one ``.bin`` read per item); same item API as the mmap reader."""

    def __init__(self, path: str) -> None:
        self._path = path
        idx_path = index_file_path(path)
        if not os.path.isfile(idx_path):
            raise IndexedDatasetError(f"index file not found: {idx_path}")
        raw = open(idx_path, "rb").read()  # noqa: SIM115 - small file, read at once
        if raw[:8] != LEGACY_MAGIC:
            raise IndexedDatasetError(f"{idx_path}: wrong magic {raw[:8]!r}, expected {LEGACY_MAGIC!r} (legacy cached)")
        if len(raw) < _HEADER_BYTES:
            raise IndexedDatasetError(f"{idx_path}: truncated header ({len(raw)} of {_HEADER_BYTES} bytes)")
        (version,) = struct.unpack("<Q", raw[8:16])
        if version != 1:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version}, expected 1")
        code, self.element_size = struct.unpack("<QQ", raw[16:32])
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}; valid codes {sorted(DTYPES)}")
        self.dtype = np.dtype(DTYPES[code])
        self._len, num_sizes = struct.unpack("<QQ", raw[32:48])
        (num_docs,) = struct.unpack("<Q", raw[48:56])
        expected = _HEADER_BYTES + 8 * (2 * (self._len + 1) + num_sizes + num_docs)
        if len(raw) != expected:
            raise IndexedDatasetError(f"{idx_path}: size {len(raw)} bytes does not match its header ({expected} bytes)")
        arrays = np.frombuffer(raw, dtype=np.int64, offset=_HEADER_BYTES)
        n1 = self._len + 1
        self.dim_offsets = arrays[:n1]
        self.data_offsets = arrays[n1 : 2 * n1]
        all_sizes = arrays[2 * n1 : 2 * n1 + num_sizes]
        self.doc_idx = arrays[2 * n1 + num_sizes :]
        if num_sizes != self._len or np.any(np.diff(self.dim_offsets) != 1):
            raise IndexedDatasetError(f"{idx_path}: only 1-D items are supported")
        self._sizes = all_sizes.astype(np.int32)
        bin_path = data_file_path(path)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"data file not found: {bin_path}")
        needed = int(self.data_offsets[-1]) * self.element_size
        if os.path.getsize(bin_path) != needed:
            raise IndexedDatasetError(
                f"{bin_path}: size {os.path.getsize(bin_path)} bytes, but {idx_path} describes {needed} bytes"
            )
        if self.element_size != self.dtype.itemsize:
            raise IndexedDatasetError(
                f"{idx_path}: element size {self.element_size} does not match dtype {self.dtype.name} "
                f"({self.dtype.itemsize} bytes)"
            )
        # The same structural check as the mmap format (offsets here count elements, pointers there bytes).
        check_index(idx_path, bin_path, self.dtype, all_sizes, self.data_offsets[:-1] * self.element_size, self.doc_idx)

    def __len__(self) -> int:
        return self._len

    @property
    def sizes(self) -> np.ndarray:
        """``int32[N]`` tokens per item."""
        return self._sizes

    @property
    def path(self) -> str:
        return self._path

    def _read(self, start: int, count: int) -> np.ndarray:
        with open(data_file_path(self._path), "rb") as f:
            f.seek(start * self.element_size)
            return np.frombuffer(f.read(count * self.element_size), dtype=self.dtype).copy()

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of item ``idx`` from ``offset``, ``length`` tokens (default: to the end)."""
        if not -self._len <= idx < self._len:
            raise IndexError(f"item {idx} out of range for {self._path} ({self._len} items)")
        idx %= self._len
        size = int(self._sizes[idx])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"item {idx} of {self._path}: offset {offset} + length {length} exceeds size {size}")
        return self._read(int(self.data_offsets[idx]) + offset, length)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class IndexedCachedDataset(IndexedDataset):
    """The ``cached`` variant: the whole ``.bin`` is read into memory once."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._cache = self._read(0, int(self.data_offsets[-1]))

    def _read(self, start: int, count: int) -> np.ndarray:
        cache = getattr(self, "_cache", None)
        if cache is None:
            return super()._read(start, count)
        return cache[start : start + count]


class IndexedDatasetBuilder:
    """Writes the legacy format (default dtype int32, as GPT-NeoX's legacy builder)."""

    def __init__(self, out_file: str, dtype: Any = np.int32) -> None:
        self._out = open(out_file, "wb")  # noqa: SIM115 - closed in finalize
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._data_offsets = [0]
        self._dim_offsets = [0]
        self._sizes: list[int] = []
        self._doc_idx = [0]

    def add_item(self, tokens: Any) -> None:
        """Append one 1-D item."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        arr = np.ascontiguousarray(np.asarray(tokens), dtype=self.dtype)
        if arr.ndim != 1:
            raise DataError(f"an item must be 1-D, got shape {arr.shape}")
        self._out.write(arr.tobytes())
        self._data_offsets.append(self._data_offsets[-1] + arr.size)
        self._sizes.append(arr.size)
        self._dim_offsets.append(self._dim_offsets[-1] + 1)

    def add_items(self, items: list[Any]) -> None:
        """Append several items."""
        for it in items:
            self.add_item(it)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._out.close()
        with open(index_file, "wb") as f:
            f.write(LEGACY_MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<QQ", dtype_code(self.dtype), self.dtype.itemsize))
            f.write(struct.pack("<QQ", len(self._data_offsets) - 1, len(self._sizes)))
            f.write(struct.pack("<Q", len(self._doc_idx)))
            for arr in (self._dim_offsets, self._data_offsets, self._sizes, self._doc_idx):
                f.write(np.asarray(arr, dtype=np.int64).tobytes())
