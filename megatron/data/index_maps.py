"""GPT-NeoX's sample-order index maps, built with vectorised numpy (no C++ helper to compile).

All functions are pure: given the same inputs (and a ``numpy.random.RandomState`` in the same state) they return
exactly the arrays GPT-NeoX builds (``_build_doc_idx``, ``helpers.build_sample_idx``, ``_build_shuffle_idx``,
``helpers.build_blending_indices``), so the cached ``.npy`` files and the sample order are interchangeable.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatron.data.index_map_params import IndexMapParams
from megatron.errors import DataError
from megatron.logging.progress import progress

PROGRESS_CHUNK = 1 << 16  # samples per progress-bar update in the Python loops

INT32_MAX = np.iinfo(np.int32).max


def num_tokens(documents: np.ndarray, sizes: np.ndarray) -> int:
    """Tokens in one epoch: the sum of the sizes of ``documents``."""
    return int(np.sum(sizes[documents], dtype=np.int64))


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest ``e >= 1`` with ``(e * tokens_per_epoch - 1) // seq_length >= num_samples``."""
    if tokens_per_epoch <= 0:
        raise DataError("the dataset has no tokens; cannot build samples from it")
    if seq_length <= 0:
        raise DataError(f"seq_length must be positive, got {seq_length}")
    # Closed form of GPT-NeoX's loop: need e * T >= num_samples * seq_length + 1.
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times and shuffled as one array (int32)."""
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    np_rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """Rows ``(index into doc_idx, offset)`` where each sample starts; sample ``i`` spans rows ``i..i+1``.

    Sample ``i`` covers global token positions ``[i*seq_length, (i+1)*seq_length]`` (``seq_length + 1`` tokens,
    consecutive samples share one token) of the concatenation of ``doc_idx``'s documents. Row ``i >= 1`` is the
    location of position ``i*seq_length``; row 0 is ``(0, 0)``. Equivalent to GPT-NeoX's C++ loop.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    dtype = np.int32 if 2 * (num_samples + 1) < INT32_MAX else np.int64
    doc_lengths = sizes[doc_idx].astype(np.int64)  # [len(doc_idx)]
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])  # starts[j] = first global position of doc_idx[j]
    # The document holding position p = k * seq_length is the last j with starts[j] <= p (this skips empty
    # documents, as the loop does), i.e. j = #{j : starts[j] <= p} - 1. Since starts[j] <= k * seq_length iff
    # ceil(starts[j] / seq_length) <= k, a histogram of those ceilings and its running sum give j for every k in
    # O(len(doc_idx) + num_samples), with no search.
    first_sample = -(-starts // seq_length)  # [len(doc_idx) + 1]
    counts = np.bincount(first_sample[first_sample <= num_samples], minlength=num_samples + 1)
    j = np.cumsum(counts)[1:] - 1  # [num_samples], for k = 1..num_samples
    sample_idx = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_idx[1:, 0] = j
    sample_idx[1:, 1] = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length - starts[j]
    return sample_idx


def build_shuffle_idx(size: int, np_rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``arange(size)`` (uint32, or int64 when huge) drawn from ``np_rng``."""
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_idx = np.arange(size, dtype=dtype)
    np_rng.shuffle(shuffle_idx)
    return shuffle_idx


def build_packed(
    documents: np.ndarray, sizes: np.ndarray, params: IndexMapParams
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPT-NeoX's ``pack_impl="packed"`` maps: ``(doc_idx, sample_idx, shuffle_idx)``; ``params.num_samples`` may be
    None only with ``params.num_epochs``."""
    tokens_per_epoch = num_tokens(documents, sizes)
    if params.num_epochs:
        epochs = params.num_epochs
    elif params.num_samples is None:
        raise ValueError("build_packed needs num_samples or num_epochs")
    else:
        epochs = num_epochs_for(tokens_per_epoch, params.seq_length, params.num_samples)
    np_rng = np.random.RandomState(seed=params.seed)
    doc_idx = build_doc_idx(documents, epochs, np_rng)
    sample_idx = build_sample_idx(sizes, doc_idx, params.seq_length, epochs, tokens_per_epoch)
    shuffle_idx = build_shuffle_idx(sample_idx.shape[0] - 1, np_rng)
    return doc_idx, sample_idx, shuffle_idx


def _usable(
    documents: np.ndarray, sizes: np.ndarray, params: IndexMapParams, all_masked: Callable[[int], bool] | None
) -> np.ndarray:
    """Mask over ``documents`` of those a non-packed sample may use."""
    ok = np.ones(len(documents), dtype=bool)
    if not params.allow_chopped:
        ok &= sizes[documents] <= params.seq_length + 1
    if all_masked is not None:
        docs = progress(documents, desc="finding fully masked documents", unit="doc")
        ok &= np.array([not all_masked(int(d)) for d in docs], dtype=bool)
    if not ok.any():
        raise DataError("no document can be used: all are longer than seq_length + 1 or fully masked")
    return ok


def _shuffled_samples(params: IndexMapParams) -> tuple[int, np.random.RandomState, np.ndarray]:
    """The non-packed builders' first draw: ``(num_samples, rng, shuffle_idx)`` with ``shuffle_idx`` a
    permutation of ``arange(num_samples)``, as GPT-NeoX draws it before anything else."""
    if params.num_samples is None:
        raise ValueError(f"pack_impl {params.pack_impl} needs num_samples (None only with pack_impl packed)")
    np_rng = np.random.RandomState(seed=params.seed)
    shuffle_idx = np.arange(params.num_samples)
    np_rng.shuffle(shuffle_idx)
    return params.num_samples, np_rng, shuffle_idx


def build_pack_until_overflow(
    documents: np.ndarray,
    sizes: np.ndarray,
    params: IndexMapParams,
    all_masked: Callable[[int], bool] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPT-NeoX's ``pack_until_overflow``: shuffled documents are appended to a sample until the next one would
    overflow ``seq_length + 1`` tokens, then it starts the next sample. The document order is reshuffled each
    pass with the same rng draws as GPT-NeoX. ``sample_idx[k] = (first doc_idx position of sample k, 0)``.

    Differences from GPT-NeoX, on purpose: positions are mapped through ``documents`` (GPT-NeoX uses positions
    ``0..len(documents)-1`` as item ids, which reads training documents for the valid/test splits).
    """
    num_samples, np_rng, shuffle_idx = _shuffled_samples(params)
    usable = _usable(documents, sizes, params, all_masked)
    seq_length = params.seq_length
    order = np.arange(len(documents))
    np_rng.shuffle(order)
    doc_sizes = sizes[documents]
    starts: list[int] = []
    doc_idx: list[int] = []
    running = 0
    cursor = 0
    bar = progress(desc="packing samples", total=num_samples, unit="sample")
    while len(starts) < num_samples:
        pos = int(order[cursor])
        if usable[pos]:
            length = int(doc_sizes[pos])
            if running == 0 or running + length > seq_length + 1:
                starts.append(len(doc_idx))
                running = length
                if len(starts) % PROGRESS_CHUNK == 0:
                    bar.update(PROGRESS_CHUNK)
            else:
                running += length
            doc_idx.append(int(documents[pos]))
        cursor += 1
        if cursor == len(documents):
            cursor = 0
            np_rng.shuffle(order)
    bar.close()
    starts.append(len(doc_idx))
    sample_idx = np.zeros((len(starts), 2), dtype=np.int64)
    sample_idx[:, 0] = starts
    return np.asarray(doc_idx, dtype=np.int64), sample_idx, shuffle_idx


def build_unpacked(
    documents: np.ndarray,
    sizes: np.ndarray,
    params: IndexMapParams,
    all_masked: Callable[[int], bool] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPT-NeoX's ``unpacked``: one document per sample, documents in order (cycling), samples shuffled.

    ``sample_idx[k] = (k, 0)``; ``doc_idx`` lists ``num_samples + 1`` usable documents.
    """
    num_samples, _, shuffle_idx = _shuffled_samples(params)
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = np.arange(num_samples + 1)
    usable_docs = np.asarray(documents)[_usable(documents, sizes, params, all_masked)]
    doc_idx = np.resize(usable_docs.astype(np.int64), num_samples + 1)  # cycles through the usable documents
    return doc_idx, sample_idx, shuffle_idx


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """GPT-NeoX's deterministic greedy blend: sample ``k`` goes to the dataset maximising
    ``w_d * max(k, 1) - count_d`` (first one on ties). Returns ``(dataset_index uint8, dataset_sample_index int64)``.
    """
    w = [float(x) for x in np.asarray(weights, dtype=np.float64)]
    n = len(w)
    if n == 0 or n > 255:
        raise DataError(f"blending needs 1..255 datasets, got {n}")
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if n == 1:
        dataset_sample_index[:] = np.arange(size)
        return dataset_index, dataset_sample_index
    counts = [0] * n
    choice = [0] * size
    # Inherently sequential (each pick depends on all earlier ones); plain floats keep it exact and fast enough.
    rng_n = range(1, n)
    with progress(desc="blending datasets", total=size, unit="sample") as bar:
        for lo in range(0, size, PROGRESS_CHUNK):  # the bar advances per chunk: nothing added to the inner loop
            for k in range(lo, min(lo + PROGRESS_CHUNK, size)):
                kd = float(k) if k > 1 else 1.0
                best = 0
                best_err = w[0] * kd - counts[0]
                for d in rng_n:
                    err = w[d] * kd - counts[d]
                    if err > best_err:
                        best_err = err
                        best = d
                choice[k] = best
                counts[best] += 1
            bar.update(min(PROGRESS_CHUNK, size - lo))
    dataset_index[:] = choice
    # The running count of each dataset before sample k is that sample's index inside its dataset.
    idx = dataset_index.astype(np.int64)
    for d in range(n):
        mask = idx == d
        dataset_sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, dataset_sample_index
