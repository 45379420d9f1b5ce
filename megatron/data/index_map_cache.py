"""Whether cached index maps may be reused: a stamp of everything they depend on, and a check of their contents.

The ``.npy`` files keep GPT-NeoX's names (see :mod:`megatron.data.gpt2_dataset`); GPT-NeoX's names do not encode the
split's document range nor the data files, so a cache of another split (same split name, other ``split`` ratios)
or of data preprocessed again would be reused. A side file ``…_indexmap_…_stamp.json`` records the inputs —
document range, the data (and label) files' identity, ``num_samples``, ``seq_length``, ``seed``, ``pack_impl``,
``allow_chopped``, ``num_epochs`` — and the maps are reused only when it matches and their contents are in range.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from megatron.data.cache_stamps import STAMP_VERSION, differences, read_stamp
from megatron.data.index_format import file_identity
from megatron.data.index_map_params import IndexMapParams

MAP_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def stamp_path(paths: dict[str, str]) -> str:
    """The stamp next to the three map files: ``…_indexmap_…_stamp.json``."""
    return paths["doc_idx"][: -len("doc_idx.npy")] + "stamp.json"


def _identity(prefix: str | None) -> dict[str, int] | None:
    try:
        return file_identity(prefix) if prefix else None
    except OSError:
        return None  # an in-memory dataset or one without files: nothing to key on


def expected_stamp(
    data_prefix: str, documents: np.ndarray, params: IndexMapParams, label_prefix: str | None = None
) -> dict[str, Any]:
    """The stamp the maps for these inputs carry."""
    docs = np.ascontiguousarray(documents)  # no copy for the usual arange; the CRC reads its buffer in place
    return {
        "version": STAMP_VERSION,
        "data": _identity(data_prefix),
        "labels": _identity(label_prefix),
        "documents": [int(docs.min()), int(docs.max()), len(docs), docs.dtype.name, zlib.crc32(docs.data)],
        "num_samples": params.num_samples,
        "seq_length": params.seq_length,
        "seed": params.seed,
        "pack_impl": params.pack_impl,
        "allow_chopped": params.allow_chopped,
        "num_epochs": params.num_epochs,
    }


def content_problem(maps: tuple[np.ndarray, ...], documents: np.ndarray, sizes: np.ndarray, pack_impl: str) -> str:
    """Why loaded maps cannot be those of ``documents`` ('' when they can): document ids outside the split, rows
    outside ``doc_idx``, offsets past a document's end, shuffled ids outside the samples."""
    doc_idx, sample_idx, shuffle_idx = maps
    if doc_idx.ndim != 1 or sample_idx.ndim != 2 or sample_idx.shape[1:] != (2,) or shuffle_idx.ndim != 1:
        return "the arrays have the wrong shapes"
    if len(doc_idx) == 0 or len(sample_idx) == 0:
        return "the arrays are empty"
    lo, hi = int(np.min(documents)), int(np.max(documents))
    if int(doc_idx.min()) < lo or int(doc_idx.max()) > hi:
        return f"doc_idx holds documents {int(doc_idx.min())}..{int(doc_idx.max())}, outside this split's {lo}..{hi}"
    rows = np.asarray(sample_idx[:, 0], dtype=np.int64)
    limit = len(doc_idx) + (pack_impl != "packed")  # non-packed: the last row is one past the end
    if int(rows.min()) < 0 or int(rows.max()) >= limit:
        return f"sample_idx points at doc_idx rows up to {int(rows.max())}, but doc_idx has {len(doc_idx)}"
    if pack_impl == "packed":
        offsets = np.asarray(sample_idx[:, 1], dtype=np.int64)
        lengths = np.asarray(sizes, dtype=np.int64)[np.asarray(doc_idx, dtype=np.int64)[rows]]
        if int(offsets.min()) < 0 or bool(np.any(offsets > lengths)):
            return "sample_idx has offsets past the end of their documents (the data changed)"
    if len(shuffle_idx) and (int(shuffle_idx.min()) < 0 or int(shuffle_idx.max()) >= len(sample_idx) - 1):
        return f"shuffle_idx holds samples up to {int(shuffle_idx.max())}, but there are {len(sample_idx) - 1}"
    return ""


def load_valid(
    paths: dict[str, str],
    stamp: dict[str, Any],
    documents: np.ndarray,
    sizes: np.ndarray,
    pack_impl: str,
    check_contents: bool = True,
) -> tuple[tuple[np.ndarray, ...] | None, str]:
    """``(maps, '')`` when the cache at ``paths`` may be used for ``stamp``, else ``(None, why not)``.

    The content check reads the maps once (~1 s per 10 million samples, a seventh of building them); the building
    rank runs it, the others (``check_contents=False``) trust its stamp."""
    why = differences(read_stamp(stamp_path(paths)), stamp)
    if why:
        return None, why
    try:
        maps = tuple(np.load(paths[k], allow_pickle=False, mmap_mode="r") for k in MAP_NAMES)
    except (OSError, ValueError, EOFError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    problem = content_problem(maps, documents, sizes, pack_impl) if check_contents else ""
    return (None, problem) if problem else (maps, "")
