"""GPT-NeoX's ``GPT2Dataset``: fixed-length samples over an indexed dataset, in GPT-NeoX's order for a seed.

The index maps (``doc_idx``, ``sample_idx``, ``shuffle_idx``) are built by :mod:`megatron.data.index_maps` and
cached next to the data under GPT-NeoX's names::

    {prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{pack_impl}pi[_ac]_{doc_idx|sample_idx|shuffle_idx}.npy

Next to them a stamp ``…_stamp.json`` records what they were built from (document range, data files, parameters);
a cache whose stamp or contents do not fit is rebuilt (:mod:`megatron.data.index_map_cache`).

With ``torch.distributed`` initialised, one rank builds (global rank 0, or each node's local rank 0 when
``use_shared_fs=False``) while the others wait on a barrier; without it, the single process builds. Files are
written under temporary names and renamed, so an interrupted build never leaves a half-written cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron import mpu
from megatron.data import index_map_cache as map_cache
from megatron.data import index_maps
from megatron.data.cache_stamps import remove_stamp, write_stamp
from megatron.data.index_map_params import IndexMapParams
from megatron.errors import DataError

logger = logging.getLogger(__name__)

PACK_IMPLS = ("packed", "pack_until_overflow", "unpacked")
MAP_NAMES = map_cache.MAP_NAMES


def index_map_paths(data_prefix: str, name: str, params: IndexMapParams) -> dict[str, str]:
    """GPT-NeoX's cache file names for the three index maps (``num_epochs`` is not part of them)."""
    p = params
    base = f"{data_prefix}_{name}_indexmap_{p.num_samples}ns_{p.seq_length}sl_{p.seed}s_{p.pack_impl}pi"
    if p.allow_chopped:
        base += "_ac"
    return {key: f"{base}_{key}.npy" for key in MAP_NAMES}


def is_cache_builder(use_shared_fs: bool) -> bool:
    """True on the rank that builds caches next to the data (the others wait on a barrier, then read them)."""
    if not mpu.is_distributed():
        return True
    if use_shared_fs:
        return mpu.world_rank() == 0
    return mpu.local_rank() == 0


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def load_or_build_index_maps(
    name: str,
    data_prefix: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    params: IndexMapParams,
    use_shared_fs: bool = True,
    all_masked: Callable[[int], bool] | None = None,
    barrier: Callable[[], None] | None = None,
    label_prefix: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load the cached index maps, building and saving them first where needed (see the module docstring).

    A cache is reused only when its stamp matches these inputs and its contents fit them
    (:mod:`megatron.data.index_map_cache`); a stale, corrupt or unstamped cache is rebuilt, with one log line why.
    """
    if params.pack_impl not in PACK_IMPLS:
        raise DataError(f"unknown pack_impl {params.pack_impl!r}; valid: {', '.join(PACK_IMPLS)}")
    if params.num_samples is None and (params.pack_impl != "packed" or not params.num_epochs):
        raise DataError("num_samples may only be None (epoch-based training) with pack_impl packed and num_epochs")
    paths = index_map_paths(data_prefix, name, params)
    stamp = map_cache.expected_stamp(data_prefix, documents, params, label_prefix)
    if is_cache_builder(use_shared_fs):
        cached, why = map_cache.load_valid(paths, stamp, documents, sizes, params.pack_impl)
        if cached is None:
            if any(os.path.exists(p) for p in paths.values()):
                logger.warning("rebuilding the %s index maps of %s: the cached ones are %s", name, data_prefix, why)
            try:
                remove_stamp(map_cache.stamp_path(paths))
                _build(paths, name, data_prefix, documents, sizes, params, all_masked)
            except OSError as e:
                raise DataError(
                    f"cannot write the {name} index maps next to {data_prefix} ({e}); the data folder must be "
                    "writable (GPT-NeoX writes its caches there too)"
                ) from None
            write_stamp(map_cache.stamp_path(paths), stamp)
    if barrier is not None:
        barrier()
    else:
        mpu.barrier()
    for path in paths.values():
        if not os.path.isfile(path):
            raise DataError(
                f"index map {path} is missing after the build step; with use_shared_fs=True the data directory must "
                "be on a file system all ranks share (else set use_shared_fs: false)"
            )
    # Checked (or just built) by the building rank before the barrier: the stamp and a clean load suffice here.
    maps, why = map_cache.load_valid(paths, stamp, documents, sizes, params.pack_impl, check_contents=False)
    if maps is None:
        raise DataError(f"the {name} index maps {map_cache.stamp_path(paths)[: -len('stamp.json')]}*: {why}")
    doc_idx, sample_idx, shuffle_idx = maps
    return doc_idx, sample_idx, shuffle_idx


def _build(
    paths: dict[str, str],
    name: str,
    data_prefix: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    params: IndexMapParams,
    all_masked: Callable[[int], bool] | None,
) -> None:
    start = time.perf_counter()
    logger.info(
        "building %s index maps for %s (%s samples, seq %d)", name, data_prefix, params.num_samples, params.seq_length
    )
    if params.pack_impl == "packed":
        maps = index_maps.build_packed(documents, sizes, params)
    elif params.pack_impl == "pack_until_overflow":
        maps = index_maps.build_pack_until_overflow(documents, sizes, params, all_masked)
    else:
        maps = index_maps.build_unpacked(documents, sizes, params, all_masked)
    for key, array in zip(MAP_NAMES, maps):
        _save_atomic(paths[key], array)
    logger.info("built %s index maps in %.2f s", name, time.perf_counter() - start)


class GPT2Dataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens: ``{"text": int64[seq_length + 1]}`` (+ ``"label"`` with a label dataset).

    ``documents`` are item indices of ``indexed_dataset`` (each item is one document). Sample ``i`` is
    ``shuffle_idx[i]``-th packed window, exactly as GPT-NeoX. Short samples are padded with 0 (labels with -100),
    long ones truncated.
    """

    def __init__(
        self,
        name: str,
        data_prefix: str,
        documents: np.ndarray,
        indexed_dataset: Any,
        params: IndexMapParams,
        build_index_mappings: bool = True,
        use_shared_fs: bool = True,
        label_dataset: Any = None,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.pack_impl = params.pack_impl
        self.allow_chopped = params.allow_chopped
        self.indexed_dataset = indexed_dataset
        self.label_dataset = label_dataset
        self.seq_length = seq_length = params.seq_length
        documents = np.asarray(documents)
        if len(documents) == 0:
            raise DataError(f"{data_prefix}: the {name} split has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset.sizes):
            raise DataError(f"{data_prefix}: document ids must lie in [0, {len(indexed_dataset.sizes)})")
        if label_dataset is not None and not np.array_equal(label_dataset.sizes, indexed_dataset.sizes):
            raise DataError(f"{data_prefix}: the label dataset's item sizes differ from the text dataset's")
        if build_index_mappings:
            all_masked = None
            if label_dataset is not None:

                def all_masked(doc: int) -> bool:
                    return bool(np.all(label_dataset.get(doc)[: seq_length + 1] == -100))

            self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_index_maps(
                name,
                data_prefix,
                documents,
                indexed_dataset.sizes,
                params,
                use_shared_fs=use_shared_fs,
                all_masked=all_masked,
                barrier=barrier,
                label_prefix=getattr(label_dataset, "path", None),
            )
            self.shuffle_idx_len = self.shuffle_idx.shape[0] - 1
            self.sample_idx_len = self.sample_idx.shape[0] - 1

    def __len__(self) -> int:
        return min(self.shuffle_idx_len, self.sample_idx_len)

    def _window(self, dataset: Any, j: int) -> np.ndarray:
        """Tokens of packed window ``j`` (rows ``j`` and ``j+1`` of sample_idx) from ``dataset``."""
        doc_f, off_f = (int(x) for x in self.sample_idx[j])
        doc_l, off_l = (int(x) for x in self.sample_idx[j + 1])
        if self.pack_impl != "packed":
            # A sample is whole documents doc_f..doc_l-1 (GPT-NeoX also appends one token of doc_l; we do not).
            return np.concatenate([dataset.get(int(self.doc_idx[i])) for i in range(doc_f, doc_l)])
        if doc_f == doc_l:
            return dataset.get(int(self.doc_idx[doc_f]), offset=off_f, length=off_l - off_f + 1)
        parts = [dataset.get(int(self.doc_idx[doc_f]), offset=off_f)]
        parts.extend(dataset.get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l))
        parts.append(dataset.get(int(self.doc_idx[doc_l]), length=off_l + 1))
        return np.concatenate(parts)

    def _fit(self, tokens: np.ndarray, pad: int) -> np.ndarray:
        out = np.full(self.seq_length + 1, pad, dtype=np.int64)
        n = min(len(tokens), self.seq_length + 1)
        out[:n] = tokens[:n]
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        try:
            j = int(self.shuffle_idx[idx])
            text = self._window(self.indexed_dataset, j)
            sample = {"text": self._fit(text, 0)}
            if self.label_dataset is not None:
                sample["label"] = self._fit(self._window(self.label_dataset, j), -100)
            return sample
        except IndexError:
            # GPT-NeoX's behaviour: an index past the end wraps around.
            if len(self) == 0 or 0 <= idx < len(self):
                raise
            return self[idx % len(self)]
