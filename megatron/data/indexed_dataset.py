"""GPT-NeoX/Megatron ``.bin``/``.idx`` token datasets: the ``mmap`` format (reader and builder) and the factory.

A dataset is a path prefix ``P`` with ``P.bin`` (raw token arrays, C order) and ``P.idx``. The ``mmap`` index
(magic ``MMIDIDX``) is, little-endian::

    0   9 bytes  magic b"MMIDIDX\\x00\\x00"
    9   <Q       version = 1
    17  <B       dtype code (see DTYPES)
    18  <Q       N = number of items (sequences)
    26  <Q       D = length of doc_idx
    34  int32[N] sizes (tokens per item)
    ..  int64[N] pointers (byte offset of each item in .bin)
    ..  int64[D] doc_idx (item index where each document starts; starts with 0)

Files written here are byte-identical to GPT-NeoX's for the same tokens. The legacy ``cached``/``lazy`` format
(magic ``TNTIDX``) lives in :mod:`megatron.data.legacy_indexed_dataset`; :func:`make_dataset` reads both and
``impl="infer"`` picks by magic (GPT-NeoX's ``infer`` returns ``None``; ours works).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron.data.index_format import (
    DTYPES,
    IMPLS,
    LEGACY_MAGIC,
    MMAP_HEADER_BYTES,
    MMAP_MAGIC,
    IndexedDatasetError,
    best_fitting_dtype,
    check_index,
    data_file_path,
    dtype_code,
    index_file_path,
    infer_dataset_impl,
    read_magic,
)
from megatron.data.legacy_indexed_dataset import IndexedCachedDataset, IndexedDataset, IndexedDatasetBuilder
from megatron.errors import DataError

logger = logging.getLogger(__name__)

# GPT-NeoX's module offers the format helpers too (they live in index_format, below both readers).
__all__ = [
    "DTYPES",
    "IMPLS",
    "LEGACY_MAGIC",
    "MMAP_HEADER_BYTES",
    "MMAP_MAGIC",
    "IndexedCachedDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MMapIndex",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "best_fitting_dtype",
    "data_file_path",
    "dataset_exists",
    "dtype_code",
    "index_file_path",
    "infer_dataset_impl",
    "make_builder",
    "make_dataset",
    "read_magic",
    "write_mmap_index",
]


def _pointers(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of every item: exclusive cumulative sum of ``sizes * itemsize``."""
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    return pointers


def write_mmap_index(
    path: str, dtype: Any, sizes: Sequence[int] | np.ndarray, doc_idx: Sequence[int] | np.ndarray
) -> None:
    """Write an ``MMIDIDX`` index file for items of ``sizes`` tokens."""
    sizes_arr = np.asarray(sizes, dtype=np.int32)
    doc_arr = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MMAP_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes_arr)))
        f.write(struct.pack("<Q", len(doc_arr)))
        f.write(sizes_arr.tobytes(order="C"))
        f.write(_pointers(sizes_arr, np.dtype(dtype).itemsize).tobytes(order="C"))
        f.write(doc_arr.tobytes(order="C"))


class MMapIndex:
    """The parsed ``.idx`` of an mmap dataset (memory-mapped, validated against its own header)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"index file not found: {path}")
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(MMAP_HEADER_BYTES)
        if header[:9] != MMAP_MAGIC:
            raise IndexedDatasetError(
                f"{path}: wrong magic {header[:9]!r}, expected {MMAP_MAGIC!r} (is it a legacy 'cached' index? use data_impl infer)"
            )
        if len(header) < MMAP_HEADER_BYTES:
            raise IndexedDatasetError(f"{path}: truncated header ({len(header)} of {MMAP_HEADER_BYTES} bytes)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise IndexedDatasetError(f"{path}: unsupported index version {version}, expected 1")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}; valid codes {sorted(DTYPES)}")
        self.dtype = np.dtype(DTYPES[code])
        self.num_items, self.num_docs = struct.unpack("<QQ", header[18:34])
        expected = MMAP_HEADER_BYTES + 4 * self.num_items + 8 * self.num_items + 8 * self.num_docs
        if file_size != expected:
            raise IndexedDatasetError(
                f"{path}: size {file_size} bytes does not match its header ({self.num_items} items, "
                f"{self.num_docs} doc_idx entries -> {expected} bytes); the file is truncated or corrupt"
            )
        # An empty memmap is not allowed by numpy; small/empty indexes are read into memory instead.
        buf = np.memmap(path, mode="r", order="C") if file_size > 0 else np.zeros(0, np.uint8)
        self._buf = buf
        offset = MMAP_HEADER_BYTES
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=self.num_items, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=self.num_items, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=self.num_docs, offset=offset)

    def __len__(self) -> int:
        return self.num_items


class MMapIndexedDataset:
    """Reader for ``P.bin``/``P.idx`` (mmap format); items are numpy arrays of the stored dtype.

    Pickles by path, so it can be sent to DataLoader workers.
    """

    def __init__(self, path: str, skip_warmup: bool = True) -> None:
        self._do_init(path, skip_warmup)

    def __getstate__(self) -> str:
        return self._path

    def __setstate__(self, state: str) -> None:
        # A DataLoader worker re-opens a dataset its parent already checked.
        self._do_init(state, True, check=False)

    def _do_init(self, path: str, skip_warmup: bool, check: bool = True) -> None:
        self._path = path
        self._index = MMapIndex(index_file_path(path))
        bin_path = data_file_path(path)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"data file not found: {bin_path}")
        bin_size = os.path.getsize(bin_path)
        if check:
            idx = self._index
            check_index(idx.path, bin_path, idx.dtype, idx.sizes, idx.pointers, idx.doc_idx)
        self._bin = np.memmap(bin_path, mode="r", order="C") if bin_size > 0 else np.zeros(0, np.uint8)
        if not skip_warmup:
            # Touch the data once so that the first epoch does not pay the page faults.
            chunk = 100 * 1024 * 1024
            for start in range(0, bin_size, chunk):
                _ = self._bin[start : start + chunk].sum()

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise DataError("slices of an indexed dataset must be contiguous (step 1)")
            sizes = self._index.sizes[start:stop]
            if len(sizes) == 0:
                return []
            total = int(sizes.astype(np.int64).sum())
            flat = np.frombuffer(self._bin, dtype=self.dtype, count=total, offset=int(self._index.pointers[start]))
            return np.split(flat, np.cumsum(sizes)[:-1])
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of item ``idx`` from ``offset`` (in tokens), ``length`` tokens (default: to the item's end)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"item {idx} out of range for {self._path} ({n} items)")
        idx %= n
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"item {idx} of {self._path}: offset {offset} + length {length} exceeds size {size}")
        ptr = int(self._index.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=ptr)

    @property
    def dtype(self) -> np.dtype:
        """Token dtype stored in the ``.bin``."""
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """``int32[N]`` tokens per item."""
        return self._index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        """``int64[D]`` document boundaries (item indices), as written by ``end_document``."""
        return self._index.doc_idx

    @property
    def path(self) -> str:
        """The dataset prefix."""
        return self._path

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path: str) -> bool:
        """True when both ``P.idx`` and ``P.bin`` exist."""
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Streams items into ``out_file`` (the ``.bin``); :meth:`finalize` writes the ``.idx``."""

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        self._data_file = open(out_file, "wb")  # noqa: SIM115 - closed in finalize
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def add_item(self, tokens: Any) -> None:
        """Append one item (a 1-D array, list or torch tensor of token ids)."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"an item must be 1-D, got shape {arr.shape}")
        self._data_file.write(np.ascontiguousarray(arr, dtype=self._dtype).tobytes(order="C"))
        self._sizes.append(len(arr))

    def add_items(self, items: Sequence[Any]) -> None:
        """Append several items with a single write (used by preprocessing for throughput)."""
        arrays = [np.asarray(it) for it in items]
        if not arrays:
            return
        self._data_file.write(np.concatenate(arrays).astype(self._dtype, copy=False).tobytes(order="C"))
        self._sizes.extend(len(a) for a in arrays)

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as concatenated tokens and per-document lengths: one item per document, each
        followed by ``end_document`` (a document without tokens adds no item). One write for all of them."""
        self._data_file.write(np.ascontiguousarray(flat, dtype=self._dtype).tobytes(order="C"))
        count = len(self._sizes)
        for n in lengths:
            if n:
                self._sizes.append(int(n))
                count += 1
            self._doc_idx.append(count)

    def end_document(self) -> None:
        """Mark that the items so far end a document."""
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file: str) -> None:
        """Append another dataset (prefix) of the same dtype, keeping its document boundaries."""
        other = MMapIndexedDataset(another_file)
        if other.dtype != self._dtype:
            raise DataError(f"cannot merge {another_file} ({other.dtype}) into a {self._dtype} dataset")
        base = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        # GPT-NeoX drops the merged file's doc_idx; we keep its boundaries (shifted), without the leading 0.
        self._doc_idx.extend(int(d) + base for d in other.doc_idx[1:])
        with open(data_file_path(another_file), "rb") as f:
            while chunk := f.read(64 * 1024 * 1024):
                self._data_file.write(chunk)

    def finalize(self, index_file: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._data_file.close()
        write_mmap_index(index_file, self._dtype, self._sizes, self._doc_idx)


def make_builder(out_file: str, impl: str = "mmap", vocab_size: int | None = None) -> Any:
    """GPT-NeoX's factory: an mmap builder (dtype by vocabulary size) or a legacy one for ``cached``/``lazy``."""
    if impl == "mmap":
        return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size))
    if impl in ("cached", "lazy"):
        return IndexedDatasetBuilder(out_file)
    raise DataError(f"unknown dataset impl {impl!r} for a builder; valid: mmap, cached, lazy")


def make_dataset(path: str, impl: str = "infer", skip_warmup: bool = True) -> Any:
    """Open dataset prefix ``path``: ``mmap``, ``cached``/``lazy`` (legacy ``TNTIDX``) or ``infer`` (by magic)."""
    if impl not in IMPLS:
        raise DataError(f"unknown data_impl {impl!r}; valid: {', '.join(IMPLS)}")
    if not os.path.isfile(index_file_path(path)):
        raise IndexedDatasetError(
            f"dataset not found: {index_file_path(path)} does not exist (data paths are prefixes: "
            f"'{path}' needs {path}.bin and {path}.idx)"
        )
    if impl == "infer":
        impl = infer_dataset_impl(path)
    if impl == "mmap":
        return MMapIndexedDataset(path, skip_warmup=skip_warmup)
    return IndexedCachedDataset(path) if impl == "cached" else IndexedDataset(path)


def dataset_exists(path: str, impl: str = "infer") -> bool:
    """True when ``P.idx`` and ``P.bin`` exist."""
    return MMapIndexedDataset.exists(path)
